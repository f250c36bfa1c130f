-- Runs after prelude.lua: fields.
-- Read-only: records of one bucket checked against a listing's filters, or counted, for the review queue
-- (``RedisLedger._listing_window`` and ``count``; the caller walks the state's indexes and names the records).
-- KEYS: the records (hashes), then, when there are words, their payloads in the same order.
-- ARGV: mode ('check' or 'tally'), the state, the task and the reason to match ('' for any), how many
-- words, then (with words) the words (lower case) and which of them each record's key starts with: one
-- character per record and word ('1' or '0'; record by record), as the caller found them.
-- A record matches when it is in the state, of the task, with the reason (its error's ``reason``), and when
-- each word is in the start of its key, or anywhere in its task name, result or payload as stored (a
-- rough look that never misses: the caller checks each match exactly).
-- Returns, check: one character per record, '1' for a match, '0' for none; tally (no task, reason or
-- words): {the (reason, task) pairs found {reason, task, ...}, then per record the number of its pair (from
-- 1), 0 for a record not in the state}.
local mode, state, task, reason = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local nwords = tonumber(ARGV[5])
local words = {unpack(ARGV, 6, 5 + nwords)}
local starts = ARGV[6 + nwords]
local tally = mode == 'tally'
local n = #KEYS
if nwords > 0 then n = n / 2 end

-- The reason of an error's JSON (a string), or ''. One object without nesting or escapes: read off its text
-- (plain finds, not a pattern: a tally reads thousands; without an escape, '"reason":"' can only be the key).
local function reason_of(text)
  if not text then return '' end
  if not string.find(text, '{', 2, true) and not string.find(text, '\\', 1, true) then
    local _, at = string.find(text, '"reason":"', 1, true)
    if not at then return '' end
    local stop = string.find(text, '"', at + 1, true)
    return stop and string.sub(text, at + 1, stop - 1) or ''  -- (no end: not JSON, which a store never holds)
  end
  local ok, e = pcall(cjson.decode, text)
  if ok and type(e) == 'table' and type(e.reason) == 'string' then return e.reason end
  return ''
end

local lowered = {}  -- task name -> in lower case (a listing holds a few names, thousands of times)
local function found_words(i, name, result)
  local ltask, payload = lowered[name], nil
  if not ltask then
    ltask = string.lower(name)
    lowered[name] = ltask
  end
  result = result and string.lower(result) or ''
  for j, w in ipairs(words) do
    local at = (i - 1) * nwords + j
    if string.sub(starts, at, at) ~= '1' and not string.find(ltask, w, 1, true) and
        not string.find(result, w, 1, true) then
      payload = payload or string.lower(redis.call('GET', KEYS[n + i]) or '')
      if not string.find(payload, w, 1, true) then return false end
    end
  end
  return true
end

-- The fields a record is read for (HMGET: cheaper than the whole hash, and each field more costs): its state,
-- its task name in up to 2 chunks, its error (a reason to match, or a tally) in up to 4 and its result (words)
-- in up to 2; a longer one is read whole.
local wanted = {'s', 'n', 'n2'}
local need_error, need_result = reason ~= '' or tally, nwords > 0
local E = #wanted + 1
if need_error then
  for _, name in ipairs({'e', 'e2', 'e3', 'e4'}) do wanted[#wanted + 1] = name end
end
local R = #wanted + 1
if need_result then
  for _, name in ipairs({'r', 'r2'}) do wanted[#wanted + 1] = name end
end
local function text(rec, v, from, count, base)
  local first, second = v[from], v[from + 1]
  if not first then return nil end
  if not second then return first end  -- one chunk (a task name, most errors' first): no copy
  if v[from + count - 1] then return joined(fields_of(redis.call('HGETALL', rec)), base) end  -- longer
  local parts = {first, second}
  for j = from + 2, from + count - 1 do
    if not v[j] then break end
    parts[#parts + 1] = v[j]
  end
  return table.concat(parts)
end

local flags, pairs, numbers, found = {}, {}, {}, {}  -- found: reason -> task name -> the pair's number
for i = 1, n do
  local ok = false
  local v = redis.call('HMGET', KEYS[i], unpack(wanted))
  numbers[i] = 0
  if v[1] == state then  -- none: gone meanwhile (a failed record past its retention)
    local name = text(KEYS[i], v, 2, 2, 'n') or ''
    local why = need_error and reason_of(text(KEYS[i], v, E, 4, 'e')) or ''
    if tally then
      local names = found[why]
      if not names then
        names = {}
        found[why] = names
      end
      local number = names[name]
      if not number then
        pairs[#pairs + 1] = why
        pairs[#pairs + 1] = name
        number = #pairs / 2
        names[name] = number
      end
      numbers[i] = number
    end
    ok = (task == '' or name == task) and (reason == '' or why == reason) and
      (nwords == 0 or found_words(i, name, need_result and text(KEYS[i], v, R, 2, 'r')))
  end
  flags[i] = ok and '1' or '0'
end
if tally then return {pairs, numbers} end
return table.concat(flags)
