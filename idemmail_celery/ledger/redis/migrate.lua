-- One record of the earlier layout (1: long field names, times in seconds, an index for every
-- state) rewritten in this one, atomically; the record's TTL is kept.
-- KEYS: the old record, the new record, the index of its state (the old name: the same key), the
-- bucket's sent counter, the new payload key. ARGV: id, the token read (the record is left alone if
-- it changed since), state, index score (us), counter granule (us), payload ('' for none), then the
-- new record's fields (name, value, ...).
local old, new = KEYS[1], KEYS[2]
if redis.call('HGET', old, 'token') ~= ARGV[2] then return 0 end
local ttl = redis.call('PTTL', old)
redis.call('DEL', new)
redis.call('HSET', new, unpack(ARGV, 7))
if ttl > 0 then redis.call('PEXPIRE', new, ttl) end
redis.call('DEL', KEYS[5])
if ARGV[6] ~= '' then
  redis.call('SET', KEYS[5], ARGV[6])
  if ttl > 0 then redis.call('PEXPIRE', KEYS[5], ttl) end
end
redis.call('DEL', old)
if ARGV[3] == 'sent' then
  redis.call('ZREM', KEYS[3], ARGV[1])
  if ttl > 0 then
    local t = redis.call('TIME')
    local expires = tonumber(t[1]) * 1000000 + tonumber(t[2]) + ttl * 1000
    local granule = tonumber(ARGV[5])
    redis.call('HINCRBY', KEYS[4], string.format('%d', math.ceil(expires / granule) * granule), 1)
  end
else
  redis.call('ZADD', KEYS[3], ARGV[4], ARGV[1])
end
return 1
