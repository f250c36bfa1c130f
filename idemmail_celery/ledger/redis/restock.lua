-- Runs after prelude.lua. Entries of layout 3's time-granule archives put on their shelf, once, by the
-- migration to layout 4 (see RedisLedger.migrate_layout); idempotent.
-- KEYS: the shelf. ARGV: the sweep step (ms), then per entry: field, value, expiry (ms).
local ms = math.floor(now() / 1000)
for i = 2, #ARGV, 3 do
  shelve(ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2]), ms, tonumber(ARGV[1]))
end
return 1
