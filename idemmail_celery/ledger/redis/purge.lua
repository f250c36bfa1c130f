-- KEYS: record, the index it was found in, its payload. ARGV: id, state of that index.
-- The entry goes; the record too if it is still in that state and its TTL ran out (or it has none).
local st = redis.call('HGET', KEYS[1], 's')
if st == ARGV[2] then
  if redis.call('PTTL', KEYS[1]) > 0 then return 0 end
  redis.call('DEL', KEYS[1], KEYS[3])
end
redis.call('ZREM', KEYS[2], ARGV[1])
return 1
