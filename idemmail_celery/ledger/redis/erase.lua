-- Runs after prelude.lua (for its shelf helpers; no epoch check: an operator's change, as force).
-- KEYS: as a record script's. ARGV: expected token, expected state, then the result's chunks (count
-- first, 0 for none), then the error's, then the decision's, then the packed key and the entry's result
-- and error as the caller encoded them. Drops the payload and replaces result, error and decision of an
-- existing record whose token and state are still the ones the caller read; never creates one. Written
-- in place: state, lease and TTL stay as they are. A claim's write-ahead mark (w) stays too: it holds no
-- free text, and the caller may have read the record before its holder wrote it (see Ledger.forget).
local rec = KEYS[1]
local cur = redis.call('HMGET', rec, 't', 's')
if not cur[1] then
  local v, token = shelved(ARGV[#ARGV - 1])
  if not v or token ~= tonumber(ARGV[1]) or ARGV[2] ~= 'sent' then return 0 end
  redis.call('HSET', KEYS[SHELF], ARGV[#ARGV - 1], string.sub(v, 1, body_at(v) - 1) .. ARGV[#ARGV])
  redis.call('DEL', KEYS[8])
  return 1
end
if tonumber(cur[1]) ~= tonumber(ARGV[1]) or cur[2] ~= ARGV[2] then return 0 end
redis.call('DEL', KEYS[8])
local fields = {}
chunks(fields, 'd', chunks(fields, 'e', chunks(fields, 'r', 3)))
write(rec, fields, {}, {[R] = true, [E] = true, [D] = true})
return 1
