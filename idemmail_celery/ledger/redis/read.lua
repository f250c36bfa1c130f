-- Runs after prelude.lua. A record read whole, in one round trip.
-- KEYS: as a record script's. ARGV: the shelf's field.
-- Returns the record's hash (empty if none) and payload, then its shelved entry if live by the server's
-- clock (a clock stepped back keeps it live longer; none is ever chosen by the clock).
local h = redis.call('HGETALL', KEYS[1])
local payload = redis.call('GET', KEYS[8])
if #h == 0 then
  local v, _, expires = shelved(ARGV[1])
  if v and expires > math.floor(now() / 1000) then return {h, payload, v} end
end
return {h, payload}
