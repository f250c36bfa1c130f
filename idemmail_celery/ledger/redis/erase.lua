-- Runs after prelude.lua (for its shelf helpers; no epoch check: an operator's change, as force).
-- KEYS: as a record script's. ARGV: expected token, expected state, then the result's chunks (count
-- first, 0 for none), then the error's, then the packed key and the entry's result and error as the
-- caller encoded them. Drops the payload and replaces result and error of an existing record whose
-- token and state are still the ones the caller read; never creates one. Written in place: state,
-- lease and TTL stay as they are. A claim's write-ahead mark stays too: it holds no free text, and the
-- caller may have read the record before its holder wrote it (see Ledger.forget).
local rec = KEYS[1]
local cur = redis.call('HMGET', rec, 't', 's', 'e')
if not cur[1] then
  local v, token = shelved(ARGV[#ARGV - 1])
  if not v or token ~= tonumber(ARGV[1]) or ARGV[2] ~= 'sent' then return 0 end
  redis.call('HSET', KEYS[SHELF], ARGV[#ARGV - 1], string.sub(v, 1, body_at(v) - 1) .. ARGV[#ARGV])
  redis.call('DEL', KEYS[8])
  return 1
end
if tonumber(cur[1]) ~= tonumber(ARGV[1]) or cur[2] ~= ARGV[2] then return 0 end
local marked = cur[2] == 'claimed' and cur[3] and string.sub(cur[3], 1, 9) == '{"ahead":'
redis.call('DEL', KEYS[8])
local old = {}
for _, name in ipairs(redis.call('HKEYS', rec)) do
  local first = string.sub(name, 1, 1)
  if first == 'r' or (first == 'e' and not marked) then old[#old + 1] = name end  -- the result's and error's chunks
end
if #old > 0 then redis.call('HDEL', rec, unpack(old)) end
local fields = {}
local at = 3
for _, base in ipairs({'r', 'e'}) do
  local count = tonumber(ARGV[at])
  if base == 'e' and marked then count = 0 end
  for i = 1, count do
    fields[#fields + 1] = i == 1 and base or base .. i
    fields[#fields + 1] = ARGV[at + i]
  end
  at = at + tonumber(ARGV[at]) + 1
end
if #fields > 0 then redis.call('HSET', rec, unpack(fields)) end
return 1
