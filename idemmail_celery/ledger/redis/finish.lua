-- Runs after prelude.lua: base, index, fields, shelved, entry, shelve, write.
-- ARGV: epoch, id, token, target, retention (ms), drop_payload ('1' erases it on sent), counter
-- granule (us), then the result's chunks (their count first, 0 for none; to sent, one piece: a sent
-- record's hash goes, its result and error are only read whole), then the error's, then the
-- write-ahead mark's the move leaves (a release only; any other move drops the record's), then
-- the packed key (the shelf's field), the ledger's retention (ms: an entry with another says so), the
-- shelf's sweep step (ms), and the entry's result and error as the caller encoded them.
if lost() then return {'lost'} end
local rec, id, token, target = KEYS[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
local field, retention = ARGV[#ARGV - 3], tonumber(ARGV[#ARGV - 2])
local cur = redis.call('HMGET', rec, 's', 't', 'r', 'e', 'f', 'a', 'c', 'w', 'd')
local state = cur[1]
if not state then
  -- Shelved (sent): this very call run twice (a lost reply) is ok, anything else is stale.
  local v, held = shelved(field)
  if not v then return {'missing'} end
  if target == 'sent' and held == token then return {'ok'} end
  return {'stale', 'sent', tostring(held)}
end
local held = tonumber(cur[2])
if state == target and held == token then return {'ok'} end  -- this very call, run twice (a lost reply)
local mine = state == 'claimed' and held == token
local late_truth = target == 'sent' and token < held and
  (state == 'review' or state == 'released' or state == 'claimed')
if not (mine or late_truth) then return {'stale', state, tostring(held)} end
local n = now()
local ttl = tonumber(ARGV[5])
local at = 9 + tonumber(ARGV[8])  -- where the error's chunks begin (their count)
local new_result, new_error = at > 9, tonumber(ARGV[at]) > 0
local final = target == 'sent' or target == 'failed'
local drop_payload = target == 'sent' and ARGV[6] == '1'
local ms = math.floor(n / 1000)
-- A record an operator decided on (d: a release, say, then sent by the next claim) stays a hash of its own, as
-- force.lua writes one: an entry has no room for the decision. (Its result and error come in one piece each,
-- so such a hash may outgrow the compact encoding: a rare record, kept whole.)
if target == 'sent' and not cur[9] then
  -- Shelved: the record's hash goes; the entry keeps what a duplicate and an operator need.
  local body = ARGV[#ARGV]
  if not ((new_result or not cur[3]) and (new_error or not cur[4])) then
    -- The record keeps a result or error the caller did not pass (a late truth over a parked record).
    local f = fields_of(redis.call('HGETALL', rec))
    local r, e = {}, {}
    if new_result then chunks(r, 'r', 8) end
    if new_error then chunks(e, 'e', at) end
    body = '*[' .. (new_result and joined(fields_of(r), 'r') or joined(f, 'r') or 'null') .. ',' ..
      (new_error and joined(fields_of(e), 'e') or joined(f, 'e') or 'null') .. ']'
  end
  local attempts, reclaims = tonumber(cur[6] or 1), tonumber(cur[7] or 0)
  local expires = math.ceil((ms + ttl) / 100)  -- tenths of a second, rounded up: a shorter entry
  local value = table.concat({b36(expires), ttl == retention and '' or 'R' .. b36(ttl),
    held == 1 and '' or 'T' .. b36(held), attempts == 1 and '' or 'A' .. b36(attempts),
    reclaims == 0 and '' or 'C' .. b36(reclaims), entry_fp(cur[5]), body})
  shelve(field, value, expires * 100, ms, tonumber(ARGV[#ARGV - 1]))
  count_sent(n + ttl * 1000, tonumber(ARGV[7]))
  move(id, state, target, n + ttl * 1000)
  if drop_payload then
    redis.call('DEL', rec, KEYS[8])
  else
    redis.call('DEL', rec)
    redis.call('PEXPIRE', KEYS[8], ARGV[5])  -- ttl as the caller wrote it (see the prelude's base part)
  end
  -- The time as a read gives it back (the entry keeps its expiry in tenths of a second, rounded up, and
  -- its retention: sent = expiry - retention), in microseconds: an integer reply.
  return {'ok', (expires * 100 - ttl) * 1000}
end
move(id, state, target, string.format('%d', final and n + ttl * 1000 or n))
if target == 'sent' then count_sent(n + ttl * 1000, tonumber(ARGV[7])) end
local fields = {'s', target, 'u', string.format('%d', n)}  -- a record written in place: its result's and error's chunks too
chunks(fields, 'w', chunks(fields, 'e', chunks(fields, 'r', 8)))
-- A new result or error replaces the chunks of one the record has; its write-ahead mark is no longer true
-- and goes with the move (a release may leave one of its own).
local clear = nil
if (cur[3] and new_result) or (cur[4] and new_error) or cur[8] then
  clear = {[R] = new_result, [E] = new_error, [W] = cur[8] and true}
end
write(rec, fields, {'l'}, clear)
if drop_payload then redis.call('DEL', KEYS[8]) end
if final then expire(ttl, not drop_payload) end
return {'ok', n}
