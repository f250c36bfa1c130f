-- Runs after prelude.lua. One page of a shelf, for listing: HSCAN, each field (a key's 32 bytes, see
-- ``_field`` in layout.py) in hex (a client decodes replies as UTF-8); the sweep's field ('') left out.
-- KEYS: the shelf. ARGV: cursor, count.
local out = redis.call('HSCAN', KEYS[1], ARGV[1], 'COUNT', ARGV[2])
local items, kept = out[2], {}
for i = 1, #items, 2 do
  if items[i] ~= '' then
    kept[#kept + 1] = #items[i] == 32 and hex(items[i]) or items[i]
    kept[#kept + 1] = items[i + 1]
  end
end
return {out[1], kept}
