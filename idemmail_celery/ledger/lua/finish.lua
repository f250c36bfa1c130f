-- Runs after prelude.lua.
-- ARGV: epoch, id, token, target, retention (ms), drop_payload ('1' erases it on sent), counter
-- granule (us), then the result's chunks (their count first, 0 for none), then the error's.
if lost() then return {'lost'} end
local rec, id, token, target = KEYS[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
local cur = redis.call('HMGET', rec, 's', 't', 'r', 'e')
local state = cur[1]
if not state then return {'missing'} end
local held = tonumber(cur[2])
if state == target and held == token then return {'ok'} end  -- this very call, run twice (a lost reply)
local mine = state == 'claimed' and held == token
local late_truth = target == 'sent' and token < held and
  (state == 'review' or state == 'released' or state == 'claimed')
if not (mine or late_truth) then return {'stale', state, tostring(held)} end
local n = now()
local ttl = tonumber(ARGV[5])
local fields = {'s', target, 'u', n}
local at = chunks(fields, 'r', 8)
local new_result = at > 9
local new_error = chunks(fields, 'e', at) > at + 1
local final = target == 'sent' or target == 'failed'
if target == 'sent' then count_sent(n + ttl * 1000, tonumber(ARGV[7])) end
move(id, state, target, final and n + ttl * 1000 or n)
local clear = nil  -- a new result or error replaces the chunks of one the record has
if (cur[3] and new_result) or (cur[4] and new_error) then clear = {[R] = new_result, [E] = new_error} end
write(rec, fields, {'l'}, clear)
local drop_payload = target == 'sent' and ARGV[6] == '1'
if drop_payload then redis.call('DEL', KEYS[8]) end
if final then expire(ttl, not drop_payload) end
return {'ok'}
