-- Runs after prelude.lua.
-- ARGV: epoch, token, lease (ms)
if lost() then return {'lost'} end
local rec = KEYS[1]
local cur = redis.call('HMGET', rec, 's', 't')
if cur[1] ~= 'claimed' or tonumber(cur[2]) ~= tonumber(ARGV[2]) then
  return {'no'}
end
redis.call('HSET', rec, 'l', now() + tonumber(ARGV[3]) * 1000)
return {'ok'}
