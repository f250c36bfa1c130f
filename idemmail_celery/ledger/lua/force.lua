-- Runs after prelude.lua.
-- An operator's change: replace the record if its token is still the expected one; never creates one.
-- ARGV: id, expected_token, state, token, updated (seconds), ttl (ms, '' = never expires),
-- drop_payload, counter granule (us), then the owner's chunks (count first), the result's, the error's.
local rec, id = KEYS[1], ARGV[1]
local cur = redis.call('HMGET', rec, 's', 't')
local old = cur[1]
if not old or tonumber(cur[2]) ~= tonumber(ARGV[2]) then return 0 end
local fields = {'s', ARGV[3], 't', ARGV[4], 'u', ARGV[5]}
chunks(fields, 'e', chunks(fields, 'r', chunks(fields, 'o', 9)))
local updated = tonumber(ARGV[5]) * 1000000
local ttl = ARGV[6] ~= '' and math.max(1, tonumber(ARGV[6])) or nil
if ttl and ARGV[3] == 'sent' and old ~= 'sent' then count_sent(updated + ttl * 1000, tonumber(ARGV[8])) end
move(id, old, ARGV[3], ttl and updated + ttl * 1000 or updated)
write(rec, fields, {'l'}, {[O] = true, [R] = true, [E] = true})
if ARGV[7] == '1' then redis.call('DEL', KEYS[8]) end
expire(ttl, ARGV[7] ~= '1')
return 1
