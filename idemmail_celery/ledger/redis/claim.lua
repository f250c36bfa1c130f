-- Runs after prelude.lua: base, fields, shelved.
-- KEYS (fewer than the other record scripts': each costs the call): record, the bucket's index of
-- claimed and of released records, epoch marker, payload, shelf.
-- ARGV: epoch, id, payload, fingerprint, lease (ms), resume_owner ('' for none), then the task
-- name's chunks (their count first), then the owner's, then '1' if the claimer promises write-ahead
-- marks ('' if not: field p), then the packed key (the shelf's field).
if lost(KEYS[4]) then return {'lost'} end
local rec, id = KEYS[1], ARGV[2]
local n = now()
local lease = n + tonumber(ARGV[5]) * 1000
local h = redis.call('HGETALL', rec)
if #h == 0 then
  local field = ARGV[#ARGV]
  local v, _, expires = shelved(field)
  if v then
    if expires > math.floor(n / 1000) then return {'done', {}, redis.call('GET', KEYS[5]), v} end
  end
  local at = string.format('%d', n)  -- numbers as strings: see the prelude's base part
  redis.call('ZADD', KEYS[2], at, id)  -- the first write: one Redis refuses when out of memory
  if v then redis.call('HDEL', KEYS[SHELF], field) end  -- a dead entry goes with the new claim
  local fields = {'s', 'claimed', 't', '1', 'l', string.format('%d', lease), 'a', '1', 'c', '0', 'f', ARGV[4],
    'k', at, 'u', at}
  chunks(fields, 'o', chunks(fields, 'n', 7))
  if ARGV[#ARGV - 1] == '1' then
    fields[#fields + 1] = 'p'
    fields[#fields + 1] = '1'
  end
  redis.call('HSET', rec, unpack(fields))
  redis.call('SET', KEYS[5], ARGV[3])
  return {'acquired', n, lease}
end
local f = fields_of(h)
local state = f.s
local status = 'reopened'
local holder, promised = '', ''  -- who held it before (a reclaimed or resumed claim), and its promise: the reply says
if state == 'claimed' then
  holder, promised = joined(f, 'o'), f.p or ''
  local at = 8 + tonumber(ARGV[7])
  local own = table.concat({unpack(ARGV, at + 1, at + tonumber(ARGV[at]))})
  -- Resumed: this chain's earlier claim (resume_owner), or this very request run twice (a client
  -- that retried after the reply was lost): the owner carries a nonce, so nobody else matches.
  if (ARGV[6] ~= '' and holder == ARGV[6]) or holder == own then
    status = 'resumed'
  elseif tonumber(f.l or 0) > n then
    return {'busy', h, redis.call('GET', KEYS[5])}
  else
    status = 'reclaimed'
    redis.call('HINCRBY', rec, 'c', '1')
  end
elseif state ~= 'released' then
  return {'done', h, redis.call('GET', KEYS[5])}
end
local at = string.format('%d', n)
redis.call('ZADD', KEYS[2], at, id)
if state == 'released' then redis.call('ZREM', KEYS[3], id) end
redis.call('HINCRBY', rec, 't', '1')
redis.call('HINCRBY', rec, 'a', '1')
-- Taken over from a holder that made no write-ahead promise (no field p) and left no mark (field w): it
-- may have run, so the record gets a mark saying so ('unknown'), with that holder's token. A later look
-- (this chain's own delivery resuming the claim) then knows what this one knew.
local unknown = status == 'reclaimed' and not f.p and not f.w
local old = {}  -- the owner's chunks: the new owner's may be fewer (and the promise, if this one makes none)
for name in pairs(f) do
  if string.byte(name) == O or (name == 'p' and ARGV[#ARGV - 1] ~= '1') then old[#old + 1] = name end
end
if #old > 0 then redis.call('HDEL', rec, unpack(old)) end
local fields = {'s', 'claimed', 'l', string.format('%d', lease), 'u', at}
if ARGV[#ARGV - 1] == '1' then
  fields[#fields + 1] = 'p'
  fields[#fields + 1] = '1'
end
if unknown then  -- canonical JSON (sorted keys), as Mark.to_dict writes it: at most 64 bytes, one chunk
  fields[#fields + 1] = 'w'
  fields[#fields + 1] = string.format('{"at":%d,"stage":"unknown","token":%d}', math.floor(n / 1000000), tonumber(f.t))
end
chunks(fields, 'o', 8 + tonumber(ARGV[7]))
redis.call('HSET', rec, unpack(fields))
return {status, redis.call('HGETALL', rec), redis.call('GET', KEYS[5]), holder, promised}
