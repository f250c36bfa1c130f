-- Runs after prelude.lua.
-- An operator's change: replace the record if its token is still the expected one; never creates one.
-- The record it writes is a hash of its own (a shelved ``sent`` record comes off its shelf):
-- operators' changes are rare, and what the caller gets back is then exactly what the store holds.
-- ARGV: id, expected_token, state, token, updated (seconds), ttl (ms, '' = never expires),
-- drop_payload, counter granule (us), the packed key (the shelf's field), '1' if the holder promised
-- write-ahead marks (field p; '' if not),
-- then what the hash needs when the record comes off its shelf: fingerprint (packed), created
-- (seconds), attempts, reclaims; then the owner's chunks (count first), the result's, the error's, the
-- write-ahead mark's, the decision's and the task name's.
local rec, id, field = KEYS[1], ARGV[1], ARGV[9]
local cur = redis.call('HMGET', rec, 's', 't')
local old, held, from = cur[1], cur[2], nil
if not old then
  local v, token, expires = shelved(field)
  if v and expires > math.floor(now() / 1000) then old, held, from = 'sent', token, SHELF end
end
if not old or tonumber(held) ~= tonumber(ARGV[2]) then return 0 end
local fields = {'s', ARGV[3], 't', ARGV[4], 'u', ARGV[5]}
if ARGV[10] == '1' then
  fields[#fields + 1] = 'p'
  fields[#fields + 1] = '1'
end
local task_at = chunks(fields, 'd', chunks(fields, 'w', chunks(fields, 'e', chunks(fields, 'r', chunks(fields, 'o', 15)))))
if from then  -- off the shelf: a hash of its own again, whole
  for _, kv in ipairs({{'f', ARGV[11]}, {'k', ARGV[12]}, {'a', ARGV[13]}, {'c', ARGV[14]}}) do
    fields[#fields + 1] = kv[1]
    fields[#fields + 1] = kv[2]
  end
  chunks(fields, 'n', task_at)
end
local updated = tonumber(ARGV[5]) * 1000000
local ttl = ARGV[6] ~= '' and math.max(1, tonumber(ARGV[6])) or nil
if ttl and ARGV[3] == 'sent' and old ~= 'sent' then count_sent(updated + ttl * 1000, tonumber(ARGV[8])) end
move(id, old, ARGV[3], ttl and updated + ttl * 1000 or updated)
if from then
  redis.call('HSET', rec, unpack(fields))  -- the first write (out of memory refuses it): before the HDEL
  redis.call('HDEL', KEYS[from], field)
else
  write(rec, fields, ARGV[10] == '1' and {'l'} or {'l', 'p'}, {[O] = true, [R] = true, [E] = true, [W] = true,
    [D] = true})
end
if ARGV[7] == '1' then redis.call('DEL', KEYS[8]) end
expire(ttl, ARGV[7] ~= '1')
return 1
