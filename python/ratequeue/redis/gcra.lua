-- ratequeue: GCRA buckets in Redis; one script, several operations, one round trip.
--
-- A bucket is a string key holding its TAT (theoretical arrival time) in integer
-- microseconds since the Unix epoch of the server's clock (about 1.8e15, exact in a Lua
-- double below 2^53). No key means a full bucket: every write sets PX to the time until
-- the bucket is full again, so idle keys cost no memory.
--
-- T (take now, on TIME): ARGV[2..] per key: inc, tau -> -now (admitted, at that time)
--                                                or wait * 64 + first refusing key
-- Other ops: ARGV[1] op; ARGV[2] now: '' = the server's TIME, else microseconds (test
-- clocks only); ARGV[3] ms added to every expiry, ARGV[4], ARGV[5] per op, then per key:
-- t  take:   max_wait (-1: none), undo (1/0) | inc, tau, shadow
--              -> {ok, wait, key|mask} and with undo {.., grant time, (before, after, gen)..}
-- p  peek:   -, -  | inc, tau                                   -> {wait, used...}
-- g  give back `delta` (< 0: a charge): -, -
--            | after, before, gen, slot, grant time, held, delta, tau -> {(status, after)..}
-- l  lease:  -, -  | T, tau, units, need, give back from, to, version
--                                               -> {ok, wait, (k, start, debit, version)..}
-- With undo (t), for g and for l, KEYS holds the buckets and then one generation key per
-- bucket: it changes at every give-back that is not exact (a refund, a lease's), so an
-- exact undo never follows a TAT that only came back to the value it left by another
-- route, and a lease gives back only while its place in the schedule is where it was.
local op = ARGV[1]
local now
if op == 'T' or ARGV[2] == '' then
  local t = redis.call('TIME')
  now = t[1] * 1000000 + t[2]
else
  now = tonumber(ARGV[2])
end
local n = #KEYS

-- max(TAT, now) and the stored value ('' when absent or already full).
local function tat(key)
  local v = redis.call('GET', key)
  if v then
    local x = tonumber(v)
    if x > now then return x, v end
  end
  return now, ''
end

if op == 'T' then
  -- The fast path of try_acquire: one integer back, -now = admitted (the grant time, for
  -- a later give-back), else wait * 64 + the first refusing key (at most 63).
  local ys = {}
  for i = 1, n do
    local y = tat(KEYS[i]) + ARGV[2 * i]
    local w = y - ARGV[2 * i + 1] - now
    if w > 0 then
      -- Refused: the wait is the latest any bucket needs; nothing is written.
      for k = i + 1, n do
        local z = tat(KEYS[k]) + ARGV[2 * k] - ARGV[2 * k + 1] - now
        if z > w then w = z end
      end
      if i > 63 then i = 63 end
      return w * 64 + i
    end
    ys[i] = y
  end
  for i = 1, n do
    local y = ys[i]
    if y > now then redis.call('SET', KEYS[i], y, 'PX', math.ceil((y - now) / 1000)) end
  end
  return -now
end

local keep = tonumber(ARGV[3])

-- A new generation for bucket TAT x at a give-back that is not exact: after the last one
-- (at least now), kept at least as long as the bucket could hold a debit taken before.
local function bump(gk, x)
  local v = tonumber(redis.call('GET', gk) or '0')
  if v < now then v = now else v = v + 1 end
  local px = math.ceil((x - now) / 1000) + keep
  local old = redis.call('PTTL', gk)
  if old > px then px = old end
  redis.call('SET', gk, string.format('%d', v), 'PX', px)
end

-- Writes TAT x with its expiry; a full bucket is no key. Returns the stored value.
local function store(key, x)
  if x <= now then
    redis.call('DEL', key)
    return ''
  end
  redis.call('SET', key, x, 'PX', math.ceil((x - now) / 1000) + keep)
  return string.format('%d', x)
end

if op == 't' then
  local max_wait, undo = tonumber(ARGV[4]), ARGV[5] == '1'
  if undo then n = n / 2 end
  local xs, olds = {}, {}
  local s, slow, first = now, 0, 0
  for i = 1, n do
    local j = 3 * i + 3
    local x, v = tat(KEYS[i])
    xs[i] = x
    olds[i] = v
    if ARGV[j + 2] == '0' then
      local g = x + ARGV[j] - ARGV[j + 1]
      if g > now and first == 0 then first = i end
      if g > s then
        s = g
        slow = i
      end
    end
  end
  local wait = s - now
  if max_wait >= 0 and wait > max_wait then
    if max_wait == 0 then slow = first end
    return {0, wait, slow}
  end
  -- Granted at s: every bucket is debited at s (TAT = max(TAT, s) + inc).
  local out = {1, wait, 0}
  if undo then out[4] = string.format('%d', s) end
  local mask = 0
  for i = 1, n do
    local j = 3 * i + 3
    local x = xs[i]
    if x < s then x = s end
    local y = x + ARGV[j]
    if ARGV[j + 2] == '1' and y - ARGV[j + 1] > s then
      -- A shadow level that would refuse: counted, not debited.
      mask = mask + 2 ^ (i - 1)
      if undo then
        out[#out + 1] = ''
        out[#out + 1] = ''
        out[#out + 1] = ''
      end
    else
      local v = store(KEYS[i], y)
      if undo then
        out[#out + 1] = olds[i]
        out[#out + 1] = v
        out[#out + 1] = redis.call('GET', KEYS[n + i]) or ''
      end
    end
  end
  out[3] = mask
  return out
elseif op == 'p' then
  local out = {0}
  local w = 0
  for i = 1, n do
    local j = 2 * i + 4
    local x = tat(KEYS[i])
    local g = x + ARGV[j] - ARGV[j + 1] - now
    if g > w then w = g end
    out[i + 1] = x - now
  end
  out[1] = w
  return out
elseif op == 'g' then
  -- The one undo rule, per bucket, for a debit the client holds as a record: exact (back
  -- to the value before it, or lowered by the part given back) while it is still the
  -- bucket's latest change; otherwise a refund, only while no grant is scheduled in the
  -- future (TAT <= now + tau), of at most what the debit can still hold (it ends no lower
  -- than its grant time + its debit) and never past full; otherwise nothing. A negative
  -- delta is a charge (the debit grows). Status per key: x exact (with the new after),
  -- k kept (a grant scheduled ahead keeps its slot), r refunded, n nothing, d dropped, c
  -- charged (with the new after when it was the latest).
  local m = n / 2
  local out = {}
  for i = 1, m do
    local j = 8 * i - 2
    local k, gk = KEYS[i], KEYS[m + i]
    local after, before, g, slot = ARGV[j], ARGV[j + 1], ARGV[j + 2], ARGV[j + 3]
    local s, held, delta, tau = ARGV[j + 4], tonumber(ARGV[j + 5]), tonumber(ARGV[j + 6]),
      tonumber(ARGV[j + 7])
    local latest = after ~= '' and (redis.call('GET', k) or '') == after
      and (redis.call('GET', gk) or '') == g
    local status, new = 'n', ''
    if delta < 0 then
      local y = tat(k) - delta
      new = store(k, y)
      status = 'c'
      if not latest then new = '' end
    elseif delta > 0 and latest then
      if delta >= held and before ~= '-' then
        if before == '' then
          redis.call('DEL', k)
          new = ''
        else
          new = store(k, tonumber(before))
        end
        status = 'x'
      else
        local lowered = tonumber(after) - delta
        if slot ~= '' and tonumber(slot) > now + tau and lowered < tonumber(slot) then
          status, new = 'k', after
        else
          new = store(k, lowered)
          status = 'x'
        end
      end
    elseif delta > 0 then
      local x = tat(k)
      if x > now + tau then
        status = 'd'
      else
        local cap = delta
        if s ~= '' then
          local h = tonumber(s) + held - now
          if h < cap then cap = h end
        end
        if cap > 0 and x > now then
          local y = x - cap
          if y < now then y = now end
          store(k, y)
          bump(gk, x)
          status = 'r'
        end
      end
    end
    out[#out + 1] = status
    out[#out + 1] = new
  end
  return out
elseif op == 'l' then
  -- KEYS: the buckets, then their generation keys (the version of a lease: the last
  -- give-back that was not exact, or none).
  local m = n / 2
  local xs, dirty = {}, {}
  local wait = 0
  for i = 1, m do
    local j = 7 * i - 1
    local x = tat(KEYS[i])
    if ARGV[j + 5] ~= '' and x > now then
      -- Give back the unused part of the previous lease that is still ahead. Its
      -- recorded place is exact only while no other give-back moved the schedule
      -- (same version); otherwise nothing is given back (never more than was taken).
      local v = redis.call('GET', KEYS[m + i]) or ''
      local h, l = tonumber(ARGV[j + 5]), tonumber(ARGV[j + 4])
      if l < now then l = now end
      if v == ARGV[j + 6] and h > l then
        bump(KEYS[m + i], x)
        x = x - (h - l)
        if x < now then x = now end
        dirty[i] = true
      end
    end
    xs[i] = x
    local g = x + math.floor(ARGV[j + 3] * ARGV[j] + 0.5) - ARGV[j + 1] - now
    if g > wait then wait = g end
  end
  if wait > 0 then
    for i = 1, m do
      if dirty[i] then store(KEYS[i], xs[i]) end
    end
    return {0, wait}
  end
  local out = {1, 0}
  for i = 1, m do
    local j = 7 * i - 1
    local x, t, tau = xs[i], tonumber(ARGV[j]), tonumber(ARGV[j + 1])
    local want, need = tonumber(ARGV[j + 2]), tonumber(ARGV[j + 3])
    local k = math.floor((tau - (x - now)) / t)
    if k > want then k = want end
    local d = math.floor(k * t + 0.5)
    while k > need and x + d - tau > now do
      k = k - 1
      d = math.floor(k * t + 0.5)
    end
    if k < need then
      k = need
      d = math.floor(k * t + 0.5)
    end
    if d > 0 or dirty[i] then store(KEYS[i], x + d) end
    out[#out + 1] = k
    out[#out + 1] = x
    out[#out + 1] = d
    out[#out + 1] = redis.call('GET', KEYS[m + i]) or ''
  end
  return out
end
return redis.error_reply('ratequeue: unknown op ' .. tostring(op))
