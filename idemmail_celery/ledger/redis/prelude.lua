-- The record scripts' shared start. A record is a hash of short fields, every value within 64
-- bytes so that Redis keeps it compact (listpack):
--   s state, t token, l lease end, a attempts, c reclaims, f fingerprint, k created, u updated,
--   p '1' if the latest claim's holder promised write-ahead marks (absent if not),
--   and in chunks of at most 64 bytes (base, base2, ...; the only names starting with that letter):
--   o owner, n task name, r result, e error, w write-ahead mark (claimed records only) and d an
--   operator's decision (JSON).
-- The first payload, longer, is a string of its own beside it, gone with it (or on sent).
-- KEYS: record, the bucket's index of claimed, released, failed and review records (sorted sets),
-- the bucket's sent counter (a hash: expiry granule -> records), the bucket's epoch marker, payload,
-- then the record's shelf (``<prefix>:{bb}:d:<shelf>``, chosen by the key alone, see ``_shelf`` in
-- layout.py). A ``sent`` record lives in its shelf (field: the key's 32 bytes, see ``_field`` in
-- layout.py) as one string: its expiry (server time, in tenths of a second, rounded up), ['R' its retention (ms) if not
-- the ledger's], ['T' its token if not 1], ['A' its attempts if not 1], ['C' its reclaims if not 0],
-- the fingerprint (see ``entry_fp``), then the result and error (see ``_body`` in layout.py); numbers
-- in base 36. An entry past its expiry is dead: a claim replaces it, a read ignores it, a sweep
-- drops it. A clock stepped back only makes an entry live longer; no key is chosen by the clock.
-- ARGV[1] is always the epoch the caller expects. Times are the server's, in microseconds (an
-- operator's change writes its own clock's seconds, with a point); durations are milliseconds.
-- The helpers come in parts (``-- part: <name>`` lines): a script's first line names the parts it
-- uses (``-- Runs after prelude.lua: base, fields.``), or takes them all (``-- Runs after prelude.lua.``).
-- Every helper defined is a closure made on every call (scripts keep no state between calls), so the
-- hot scripts carry only what they call.
-- part: base
-- A number handed to redis.call is printed with '%.17g' (slow, by glibc's exact float printing): the hot
-- paths hand integers over as strings of their own, made with '%d' (the same digits, quickly).
local function now()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local function lost(marker)  -- the marker: KEYS[7] but where a script passes its own (the claim)
  local m = redis.call('HMGET', marker or KEYS[7], 'epoch', 'lost')
  return m[1] ~= ARGV[1] or m[2] ~= false
end
local SHELF = #KEYS  -- the last key: the record's shelf (a record script passes 9, the claim 6)
-- part: index
-- ``sent`` has no index (it expires by TTL; listing it scans): the counter keeps its numbers.
local IDX = {claimed=KEYS[2], released=KEYS[3], failed=KEYS[4], review=KEYS[5]}
-- A transition's first write must be one Redis refuses when out of memory (ZADD, HINCRBY, HSET):
-- once a script has written, Redis lets it finish regardless (and never refuses HDEL or DEL).
local function move(id, from, to, score)
  if IDX[to] then redis.call('ZADD', IDX[to], score, id) end
  if from and from ~= to and IDX[from] then redis.call('ZREM', IDX[from], id) end
end
local function count_sent(expires, granule)
  redis.call('HINCRBY', KEYS[6], string.format('%d', math.ceil(expires / granule) * granule), '1')
end
-- part: fields
-- Read ``count`` chunks from ARGV at ``at`` into ``fields`` as base, base2, ...; the next ARGV index.
local function chunks(fields, base, at)
  local count = tonumber(ARGV[at])
  for i = 1, count do
    fields[#fields + 1] = i == 1 and base or base .. i
    fields[#fields + 1] = ARGV[at + i]
  end
  return at + count + 1
end
local R, E, O, W, D = string.byte('r'), string.byte('e'), string.byte('o'), string.byte('w'), string.byte('d')
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
-- part: shelved
-- The shelved entry of ``field``: its value, token and expiry (ms); nil if none.
local function shelved(field)
  local v = redis.call('HGET', KEYS[SHELF], field)
  if v then
    local exp, token = string.match(v, '^([0-9a-z]+)R?[0-9a-z]*T?([0-9a-z]*)A?[0-9a-z]*C?[0-9a-z]*[.~]')
    return v, token == '' and 1 or tonumber(token, 36), tonumber(exp, 36) * 100
  end
end
-- part: entry
local function b36(x)
  x = math.floor(x)
  if x <= 0 then return '0' end
  local digits, out = '0123456789abcdefghijklmnopqrstuvwxyz', {}
  while x > 0 do
    local d = x % 36
    table.insert(out, 1, string.sub(digits, d + 1, d + 1))
    x = (x - d) / 36
  end
  return table.concat(out)
end
local function hex(raw)
  return string.format(string.rep('%02x', #raw), string.byte(raw, 1, -1))
end
-- A fingerprint as an entry holds it: '.' + the record's 37 characters (a 64-hex one, packed by
-- the caller), else '~' + its text in hex + ' ' ('~ ' for none).
local function entry_fp(f)
  if not f or f == '' then return '~ ' end
  if string.byte(f) == 126 then return '~' .. hex(string.sub(f, 2)) .. ' ' end
  return '.' .. f
end
-- part: shelve
-- Drop a shelf's dead entries (expired by ``ms``, the server's clock); how many.
local function sweep(shelf, ms)
  local h, dead = redis.call('HGETALL', shelf), {}
  for i = 1, #h, 2 do
    local exp = h[i] ~= '' and string.match(h[i + 1], '^[0-9a-z]+')
    if exp and tonumber(exp, 36) * 100 <= ms then dead[#dead + 1] = h[i] end
  end
  for i = 1, #dead, 1000 do redis.call('HDEL', shelf, unpack(dead, i, math.min(i + 999, #dead))) end
  return #dead
end
-- Put an entry on the shelf. The shelf lives as long as its longest-lived entry (its TTL only ever
-- grows: GT); dead entries go in a sweep, due at most every ``step`` ms (field '': when, by the server's
-- clock), so that a shelf written to for ever holds at most one step's worth of dead entries.
local function shelve(field, value, expires, ms, step)
  local shelf, at = KEYS[SHELF], string.format('%d', expires)
  redis.call('HSET', shelf, field, value)
  if redis.call('PEXPIREAT', shelf, at, 'GT') == 0 and redis.call('PTTL', shelf) == -1 then
    redis.call('PEXPIREAT', shelf, at)
  end
  local due = redis.call('HGET', shelf, '')
  if due and tonumber(due) > ms then return end
  if due then sweep(shelf, ms) end
  redis.call('HSET', shelf, '', string.format('%d', ms + step))
end
-- part: write
-- Write ``fields`` into the record, first dropping ``drop`` (a list of names) and the chunks of
-- every field whose first byte ``clear`` holds true (a shorter new value leaves none behind).
local function write(rec, fields, drop, clear)
  if clear then
    for _, name in ipairs(redis.call('HKEYS', rec)) do
      if clear[string.byte(name)] then drop[#drop + 1] = name end
    end
  end
  if #drop > 0 then redis.call('HDEL', rec, unpack(drop)) end
  if #fields > 0 then redis.call('HSET', rec, unpack(fields)) end
end
-- The record's expiry, and its payload's (false: the payload is gone).
local function expire(ttl, payload)
  if ttl then
    ttl = string.format('%d', ttl)
    redis.call('PEXPIRE', KEYS[1], ttl)
    if payload then redis.call('PEXPIRE', KEYS[8], ttl) end
  else
    redis.call('PERSIST', KEYS[1])
    if payload then redis.call('PERSIST', KEYS[8]) end
  end
end
-- part: body
-- Where an entry's result and error begin (after its fingerprint).
local function body_at(v)
  local p = string.find(v, '[.~]')
  if string.byte(v, p) == 46 then return p + 38 end
  return string.find(v, ' ', p, true) + 1
end
