-- Runs after prelude.lua. A record read whole, in one round trip.
-- KEYS: as a record script's. ARGV: the archive field, the archive granule (ms), the ledger's retention (ms).
-- Returns the record's hash (empty if none) and payload, then an archived entry and its granule if found;
-- {'clock', server ms} when the archives the caller named miss a granule a live entry can be in (a
-- sent record must never read as absent because a clock is off: a rotation's lookup would send again).
local h = redis.call('HGETALL', KEYS[1])
local payload = redis.call('GET', KEYS[8])
if #h == 0 then
  local width, lookback = tonumber(ARGV[2]), tonumber(ARGV[3])
  local ms = math.floor(now() / 1000)
  if granule(ARCHIVES) < math.floor(ms / width) or granule(#KEYS) > math.floor((ms - lookback) / width) then
    return {'clock', ms}
  end
  local v, i = archived(ARGV[1], width)
  if v then return {h, payload, v, granule(i)} end
end
return {h, payload}
