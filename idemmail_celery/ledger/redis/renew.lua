-- Runs after prelude.lua.
-- ARGV: epoch, token, lease (ms)[, then a write-ahead mark's chunks (their count first): it replaces
-- the record's mark, field w (see Ledger.write_ahead)]
if lost() then return {'lost'} end
local rec = KEYS[1]
local cur = redis.call('HMGET', rec, 's', 't')
if cur[1] ~= 'claimed' or tonumber(cur[2]) ~= tonumber(ARGV[2]) then
  return {'no'}
end
local fields = {'l', now() + tonumber(ARGV[3]) * 1000}
if #ARGV > 3 then
  chunks(fields, 'w', 4)
  write(rec, fields, {}, {[W] = true})
else
  redis.call('HSET', rec, unpack(fields))
end
return {'ok'}
