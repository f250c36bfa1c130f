-- KEYS: a bucket's marker. Flag it lost unless an operator acknowledged a newer epoch there.
-- ARGV: the epoch the flagging process knows to be dead ('' if none), reason, by, at
local m = redis.call('HMGET', KEYS[1], 'epoch', 'acked_at', 'lost')
if m[3] then return 0 end
if m[2] and m[1] ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'lost', ARGV[2], 'lost_by', ARGV[3], 'lost_at', ARGV[4])
return 1
