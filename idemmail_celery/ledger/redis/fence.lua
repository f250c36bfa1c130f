-- KEYS: a bucket's marker of layouts 1-3. ARGV: field, value, ... (the layout, the bucket count and the
-- lost flag, see RedisLedger._fence_old_layouts). Written over whatever is there, the epoch kept:
-- an older worker's scripts then see the flag and write nothing, and its `_judge` calls the store lost.
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1
