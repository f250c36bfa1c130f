-- KEYS: a bucket's marker. ARGV: '1' to replace it ('0': only where there is none), then field, value, ...
if ARGV[1] == '1' or redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('DEL', KEYS[1])
  redis.call('HSET', KEYS[1], unpack(ARGV, 2))
end
return 1
