-- Runs after prelude.lua. A claim taken back before it ran (see Ledger.withdraw).
-- ARGV: epoch, id, token. Only a claimed record held with that token: its hash, its payload string
-- and its entry in the claimed index go, as the claim made them (claim.lua), so the next claim of the
-- key is a new one. DEL and ZREM never meet Redis's out-of-memory refusal: a withdrawal always lands.
if lost() then return {'lost'} end
local cur = redis.call('HMGET', KEYS[1], 's', 't')
if cur[1] ~= 'claimed' or tonumber(cur[2]) ~= tonumber(ARGV[3]) then return {'no'} end
redis.call('DEL', KEYS[1], KEYS[8])
redis.call('ZREM', KEYS[2], ARGV[2])
return {'ok'}
