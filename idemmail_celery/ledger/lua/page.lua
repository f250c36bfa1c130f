-- Runs after prelude.lua. One page of a sent archive, for listing: HSCAN, each field (a key's 32
-- bytes, see ``_field`` in redis.py) in hex (a client decodes replies as UTF-8).
-- KEYS: the archive. ARGV: cursor, count.
local out = redis.call('HSCAN', KEYS[1], ARGV[1], 'COUNT', ARGV[2])
local items = out[2]
for i = 1, #items, 2 do
  if #items[i] == 32 then items[i] = hex(items[i]) end
end
return {out[1], items}
