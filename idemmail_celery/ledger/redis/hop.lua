-- A reschedule's mark (see RedisLedger.mark_hop). KEYS: the mark. ARGV: this call's nonce, its life (ms).
-- 1 when this call set it, or set it before (a client that sent it again after the reply was lost:
-- that copy published the reschedule and must not drop itself); 0 when another copy set it.
local held = redis.call('GET', KEYS[1])
if not held then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
if held == ARGV[1] then return 1 end
return 0
