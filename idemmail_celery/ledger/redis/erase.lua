-- Runs after prelude.lua (for its shelf helpers; no epoch check: an operator's change, as force).
-- KEYS: as a record script's. ARGV: expected token, then the result's chunks (count first, 0 for
-- none), then the error's, then the packed key and the entry's result and error as the caller encoded them. Drops the
-- payload and replaces result and error of an existing record whose token is still the expected
-- one; never creates one. Written in place: state, lease and TTL stay as they are.
local rec = KEYS[1]
local t = redis.call('HGET', rec, 't')
if not t then
  local v, token = shelved(ARGV[#ARGV - 1])
  if not v or token ~= tonumber(ARGV[1]) then return 0 end
  redis.call('HSET', KEYS[SHELF], ARGV[#ARGV - 1], string.sub(v, 1, body_at(v) - 1) .. ARGV[#ARGV])
  redis.call('DEL', KEYS[8])
  return 1
end
if tonumber(t) ~= tonumber(ARGV[1]) then return 0 end
redis.call('DEL', KEYS[8])
local old = {}
for _, name in ipairs(redis.call('HKEYS', rec)) do
  local first = string.sub(name, 1, 1)
  if first == 'r' or first == 'e' then old[#old + 1] = name end  -- the result's and error's chunks
end
if #old > 0 then redis.call('HDEL', rec, unpack(old)) end
local fields = {}
local at = 2
for _, base in ipairs({'r', 'e'}) do
  local count = tonumber(ARGV[at])
  for i = 1, count do
    fields[#fields + 1] = i == 1 and base or base .. i
    fields[#fields + 1] = ARGV[at + i]
  end
  at = at + count + 1
end
if #fields > 0 then redis.call('HSET', rec, unpack(fields)) end
return 1
