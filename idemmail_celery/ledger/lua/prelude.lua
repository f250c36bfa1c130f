-- The record scripts' shared start. A record is a hash of short fields, every value within 64
-- bytes so that Redis keeps it compact (listpack):
--   s state, t token, l lease end, a attempts, c reclaims, f fingerprint, k created, u updated,
--   and in chunks of at most 64 bytes (base, base2, ...; the only names starting with that letter):
--   o owner, n task name, r result and e error (JSON).
-- The first payload, longer, is a string of its own beside it, gone with it (or on sent).
-- KEYS: record, the bucket's index of claimed, released, failed and review records (sorted sets),
-- the bucket's sent counter (a hash: expiry granule -> records), the bucket's epoch marker, payload.
-- ARGV[1] is always the epoch the caller expects. Times are the server's, in microseconds (an
-- operator's change writes its own clock's seconds, with a point); durations are milliseconds.
local function now()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end
-- ``sent`` has no index (it expires by TTL; listing it scans): the counter keeps its numbers.
local IDX = {claimed=KEYS[2], released=KEYS[3], failed=KEYS[4], review=KEYS[5]}
-- A transition's first write must be one Redis refuses when out of memory (ZADD, HINCRBY, HSET):
-- once a script has written, Redis lets it finish regardless (and never refuses HDEL or DEL).
local function move(id, from, to, score)
  if IDX[to] then redis.call('ZADD', IDX[to], score, id) end
  if from and from ~= to and IDX[from] then redis.call('ZREM', IDX[from], id) end
end
local function count_sent(expires, granule)
  redis.call('HINCRBY', KEYS[6], string.format('%d', math.ceil(expires / granule) * granule), 1)
end
local function lost()
  local m = redis.call('HMGET', KEYS[7], 'epoch', 'lost')
  return m[1] ~= ARGV[1] or m[2] ~= false
end
-- Read ``count`` chunks from ARGV at ``at`` into ``fields`` as base, base2, ...; the next ARGV index.
local function chunks(fields, base, at)
  local count = tonumber(ARGV[at])
  for i = 1, count do
    fields[#fields + 1] = i == 1 and base or base .. i
    fields[#fields + 1] = ARGV[at + i]
  end
  return at + count + 1
end
local R, E, O = string.byte('r'), string.byte('e'), string.byte('o')
-- A hash's HGETALL as a table, and a chunked field of it read back whole.
local function fields_of(h)
  local f = {}
  for i = 1, #h, 2 do f[h[i]] = h[i + 1] end
  return f
end
local function joined(f, base)
  if not f[base] then return nil end
  local parts, i = {f[base]}, 2
  while f[base .. i] do
    parts[#parts + 1] = f[base .. i]
    i = i + 1
  end
  return table.concat(parts)
end
-- Write ``fields`` into the record, first dropping ``drop`` (a list of names) and the chunks of
-- every field whose first byte ``clear`` holds true (a shorter new value leaves none behind).
local function write(rec, fields, drop, clear)
  if clear then
    for _, name in ipairs(redis.call('HKEYS', rec)) do
      if clear[string.byte(name)] then drop[#drop + 1] = name end
    end
  end
  if #drop > 0 then redis.call('HDEL', rec, unpack(drop)) end
  redis.call('HSET', rec, unpack(fields))
end
-- The record's expiry, and its payload's (false: the payload is gone).
local function expire(ttl, payload)
  if ttl then
    redis.call('PEXPIRE', KEYS[1], ttl)
    if payload then redis.call('PEXPIRE', KEYS[8], ttl) end
  else
    redis.call('PERSIST', KEYS[1])
    if payload then redis.call('PERSIST', KEYS[8]) end
  end
end
