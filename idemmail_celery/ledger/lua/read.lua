-- Runs after prelude.lua. A record read whole, in one round trip.
-- KEYS: as a record script's. ARGV: the archive field, the archive granule (ms).
-- Returns the record's hash (empty if none) and payload, then an archived entry and its granule if found.
local h = redis.call('HGETALL', KEYS[1])
local payload = redis.call('GET', KEYS[8])
if #h == 0 then
  local v, i = archived(ARGV[1], tonumber(ARGV[2]))
  if v then return {h, payload, v, granule(i)} end
end
return {h, payload}
