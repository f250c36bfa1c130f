-- The key-secret roster (see RedisLedger.announce and RedisLedger.roster). KEYS: the roster hash.
-- ARGV: a member ('' to only read), its secret ids (comma-separated), its life in ms (0 or less: remove it).
-- An entry is '<expiry, ms of the server's clock>|<secret ids>'. An announcement deletes the lapsed entries;
-- a read writes nothing. Returns the live entries as a flat list: member, expiry (ms), secret ids, member, ...
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local life = tonumber(ARGV[3])
if ARGV[1] ~= '' then
  if life <= 0 then
    redis.call('HDEL', KEYS[1], ARGV[1])
  else
    redis.call('HSET', KEYS[1], ARGV[1], (now + life) .. '|' .. ARGV[2])
    -- The hash outlives its longest entry, and no more: a ledger whose workers are all gone forgets them.
    if redis.call('PTTL', KEYS[1]) < life then redis.call('PEXPIRE', KEYS[1], life) end
  end
end
local out = {}
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  local sep = string.find(all[i + 1], '|', 1, true)
  local expires = sep and tonumber(string.sub(all[i + 1], 1, sep - 1))
  if not expires or expires <= now then
    if ARGV[1] ~= '' then redis.call('HDEL', KEYS[1], all[i]) end
  else
    out[#out + 1] = all[i]
    out[#out + 1] = tostring(expires)
    out[#out + 1] = string.sub(all[i + 1], sep + 1)
  end
end
return out
