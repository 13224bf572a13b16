-- ratequeue quota ledger: one account's idempotency check, deduction and threshold
-- crossing, atomically, in one round trip. Every key shares the account's hash tag.
--
-- KEYS: 1 account hash, 2 request record (audit hash for "comp"), 3 hold expiry zset,
--       4 usage rows stream, 5 outbox list, 6 current period hash, (7 a hold's id index)
-- ARGV: 1 op, 2 now, 3-11 per op (3 request id, 4 fingerprint, 5 input, 6 output,
--       7 calls, 8 model, 9 parent, 10 meta, 11 hold expiry), 12 the account (a hold's
--       id index), 13 the request's units of your own ('name=amount;...' sorted, '' for
--       none), then what the client sends pre-encoded
--       per account and period: 14 plan version, 15 key prefix, 16 retention s,
--       17 period key, 18 period end, 19 max rows, 20... the plan: unit count, then per
--       unit its name, quota, threshold count and (basis points, level) pairs.
-- A request record is one string: its fields joined by \31 (ids hold no control chars);
-- a 15th field, the units of your own, only when the request has some.

-- Op 'c', the plain charge in the common case, with its own compact ARGV (all that can
-- be is computed and encoded by the client, once per account and period):
--   KEYS 1 account hash, 2 period hash, 3 rows stream, 4 outbox, 5 request record.
--   ARGV 1 'c', 2 now, 3 request id, 4 the record, 5 its ttl, 6 unit count n, 7.. the
--   amount per unit; then from t = 7 + n: t version, t+1 max rows, t+2 period key, and
--   from t+3 per unit its usage field ('u_<unit>'), quota, threshold count and per
--   threshold (ascending) its level and basis points.
-- Reads: the account's version and next hold expiry, the period's usage (the bonus only
-- when the quota falls short; a threshold's flag only once usage reaches its level).
-- Replies: the number of thresholds fired (an integer) once charged; {'REPLAY', record}
-- for a known id (the client tells a replay from a conflict); {'STALE'} for an old plan
-- version; {'SLOW'} having written nothing when the general 'charge' must decide (hold
-- expiry due, new period, out of quota).
if ARGV[1] == 'c' then
  local acct = redis.call('HMGET', KEYS[1], 'ver', 'nx')
  local nu = tonumber(ARGV[6])
  local t = 7 + nu
  if acct[1] ~= ARGV[t] then return {'STALE'} end
  local nx = tonumber(acct[2])
  if nx and nx <= tonumber(ARGV[2]) then return {'SLOW'} end
  local fields, spec, at = {'end'}, {}, t + 3
  for k = 1, nu do
    fields[k + 1], spec[k] = ARGV[at], at
    at = at + 3 + 2 * tonumber(ARGV[at + 2])
  end
  local pv = redis.call('HMGET', KEYS[2], unpack(fields))
  if not pv[1] then return {'SLOW'} end
  local new, fb = {}, {}
  for k = 1, nu do
    local n, cur = tonumber(ARGV[6 + k]), tonumber(pv[1 + k]) or 0
    local f = math.min(n, math.max(0, tonumber(ARGV[spec[k] + 1]) - cur))
    local g = n - f
    if g > 0 then
      local b = tonumber(redis.call('HGET', KEYS[1], 'b_' .. string.sub(ARGV[spec[k]], 3))) or 0
      if g > b then return {'SLOW'} end
    end
    new[k], fb[k] = cur + f, g
  end
  if not redis.call('SET', KEYS[5], ARGV[4], 'NX', 'EX', ARGV[5]) then
    return {'REPLAY', redis.call('GET', KEYS[5])}
  end
  local fired = 0
  for k = 1, nu do
    local a, g = spec[k], fb[k]
    if g == 0 then  -- the amount as sent: no number formatted
      redis.call('HINCRBY', KEYS[2], ARGV[a], ARGV[6 + k])
    else
      redis.call('HSET', KEYS[2], ARGV[a], string.format('%d', new[k]))
      redis.call('HINCRBY', KEYS[1], 'b_' .. string.sub(ARGV[a], 3), string.format('%d', -g))
    end
    for j = 1, tonumber(ARGV[a + 2]) do  -- levels ascending: most charges stop at the first
      local l = a + 1 + 2 * j
      if new[k] < tonumber(ARGV[l]) then break end
      local unit = string.sub(ARGV[a], 3)
      if redis.call('HSETNX', KEYS[2], 'f:' .. unit .. ':' .. ARGV[l + 1], '1') == 1 then
        redis.call('LPUSH', KEYS[4], table.concat({unit, ARGV[l + 1],
          string.format('%d', new[k]), ARGV[a + 1], ARGV[2], ARGV[t + 2]}, '|'))
        fired = fired + 1
      end
    end
  end
  if fired > 0 then redis.call('LTRIM', KEYS[4], 0, 999) end
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[t + 1], '*', 'id', ARGV[3], 'r', ARGV[4])
  return fired
end

-- Op 'p' stores an account's plan, anchor, thresholds and a new version in one step, so
-- no reader sees a plan without its version: KEYS 1 account hash; ARGV 1 'p', 2 '1' to
-- store only when the account has no plan, 3 plan JSON, 4 anchor, 5 thresholds JSON.
-- Replies 1 once stored, 0 when it had a plan (a plan an older client left without its
-- version, stopped between two commands, gets version 1).
if ARGV[1] == 'p' then
  if ARGV[2] == '1' and redis.call('HEXISTS', KEYS[1], 'plan') == 1 then
    redis.call('HSETNX', KEYS[1], 'ver', '1')
    return 0
  end
  redis.call('HSET', KEYS[1], 'plan', ARGV[3], 'anchor', ARGV[4], 'thr', ARGV[5])
  redis.call('HINCRBY', KEYS[1], 'ver', 1)
  return 1
end

local A, R, H, S, O, P = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local op, now, ver, pfx = ARGV[1], tonumber(ARGV[2]), ARGV[14], ARGV[15]
local retention, pkey, pend = tonumber(ARGV[16]), ARGV[17], ARGV[18]
local UN, MAXROWS = ARGV[13], ARGV[19]
local SEP = '\31'

local function split(s, sep)
  local out, i = {}, 1
  if s == nil or s == '' then return out end
  while true do
    local j = string.find(s, sep, i, true)
    if not j then
      out[#out + 1] = string.sub(s, i)
      return out
    end
    out[#out + 1] = string.sub(s, i, j - 1)
    i = j + 1
  end
end

-- Integers go to Redis as %d text: exact below 2**53 (the client refuses larger).
local function int(x) return string.format('%d', x) end
local function num(v) return tonumber(v) or 0 end

-- Per unit: its quota, its thresholds {bp, level, flag field} and its field names.
local units, quota, levels, uf, hf, bf = {}, {}, {}, {}, {}, {}
local at = 21
for _ = 1, tonumber(ARGV[20]) do
  local u = ARGV[at]
  units[#units + 1] = u
  quota[u] = tonumber(ARGV[at + 1])
  uf[u], hf[u], bf[u] = 'u_' .. u, 'h_' .. u, 'b_' .. u
  local lv = {}
  for k = 1, tonumber(ARGV[at + 2]) do
    local bp = ARGV[at + 1 + 2 * k]
    lv[k] = {bp, tonumber(ARGV[at + 2 + 2 * k]), 'f:' .. u .. ':' .. bp}
  end
  levels[u] = lv
  at = at + 3 + 2 * #lv
end

-- record fields
local KIND, STATUS, FP, SFP, AT, PERIOD, IN, OUT, CALLS, MODEL, PARENT, META, EXP, PARTS =
  1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14
local UNITS = 15

-- Units of your own ('name=amount;...') added to an amounts table.
local function add_units(am, s)
  for _, item in ipairs(split(s, ';')) do
    local u, n = string.match(item, '^([^=]+)=(%d+)$')
    am[u] = tonumber(n)
  end
  return am
end

local function encode_parts(parts)
  local out = {}
  for _, u in ipairs(units) do
    local pb = parts[u]
    if pb then out[#out + 1] = u .. ':' .. int(pb[1]) .. ':' .. int(pb[2]) end
  end
  return table.concat(out, ';')
end

local function decode_parts(s)
  local parts = {}
  for _, item in ipairs(split(s, ';')) do
    local u, a, b = string.match(item, '^([^:]+):(%d+):(%d+)$')
    parts[u] = {tonumber(a), tonumber(b)}
  end
  return parts
end

local function unit_amounts(rec)
  local i, o, c = num(rec[IN]), num(rec[OUT]), num(rec[CALLS])
  return add_units({tokens = i + o, input_tokens = i, output_tokens = o, calls = c}, rec[UNITS])
end

-- The account row: version, next hold expiry, bonus per unit.
local acct_fields = {'ver', 'nx'}
for _, u in ipairs(units) do acct_fields[#acct_fields + 1] = bf[u] end
local acct = redis.call('HMGET', A, unpack(acct_fields))
if acct[1] ~= ver then return {'STALE'} end
local bonus = {}
for k, u in ipairs(units) do bonus[u] = num(acct[2 + k]) end
local bonus_delta = {}

-- A period's counters: used, held and the fired flags of each unit.
local function load_period(pk)
  local fields = {'end'}
  for _, u in ipairs(units) do
    fields[#fields + 1] = uf[u]
    fields[#fields + 1] = hf[u]
    for _, l in ipairs(levels[u]) do fields[#fields + 1] = l[3] end
  end
  local v = redis.call('HMGET', pk, unpack(fields))
  local per = {key = pk, exists = v[1] ~= false, used = {}, held = {}, fired = {}}
  local k = 2
  for _, u in ipairs(units) do
    per.used[u], per.held[u] = num(v[k]), num(v[k + 1])
    k = k + 2
    for _, l in ipairs(levels[u]) do
      per.fired[l[3]] = v[k] ~= false
      k = k + 1
    end
  end
  return per
end

local function save_period(per, end_time)
  local args = {}
  for _, u in ipairs(units) do
    args[#args + 1] = uf[u]
    args[#args + 1] = int(per.used[u])
    args[#args + 1] = hf[u]
    args[#args + 1] = int(per.held[u])
  end
  if not per.exists and end_time then
    args[#args + 1] = 'end'
    args[#args + 1] = end_time
  end
  redis.call('HSET', per.key, unpack(args))
  if not per.exists and end_time then
    redis.call('EXPIRE', per.key, int(math.max(1, math.ceil(tonumber(end_time) - now + retention))))
    per.exists = true
  end
end

local function save_bonus()
  for u, d in pairs(bonus_delta) do
    if d ~= 0 then redis.call('HINCRBY', A, bf[u], int(d)) end
  end
  bonus_delta = {}
end

local function give_back(per, parts, amounts)
  for u, pb in pairs(parts) do
    if per and per.used[u] then
      per.used[u] = math.max(0, per.used[u] - pb[1])
      per.held[u] = math.max(0, per.held[u] - (amounts[u] or 0))
    end
    if pb[2] > 0 then
      bonus[u] = bonus[u] + pb[2]
      bonus_delta[u] = (bonus_delta[u] or 0) + pb[2]
    end
  end
end

-- Take amounts from the plan quota then the bonus; with force, past the quota.
-- Returns parts, or nil, unit, need, available when it does not fit.
local function take(per, am, force)
  local parts = {}
  for _, u in ipairs(units) do
    local need = am[u] or 0
    local free = math.max(0, quota[u] - per.used[u])
    local fp = math.min(need, free)
    local fb = math.min(need - fp, bonus[u])
    if not force and fp + fb < need then return nil, u, need, free + bonus[u] end
    if force then fp = need - fb end
    parts[u] = {fp, fb}
  end
  for u, pb in pairs(parts) do
    per.used[u] = per.used[u] + pb[1]
    if pb[2] ~= 0 then
      bonus[u] = bonus[u] - pb[2]
      bonus_delta[u] = (bonus_delta[u] or 0) - pb[2]
    end
  end
  return parts
end

-- Fire each threshold once per period: the flag is set in the same script.
local function fire(per, period)
  local fired, flags = 0, {}
  for _, u in ipairs(units) do
    for _, l in ipairs(levels[u]) do
      local flag = l[3]
      if per.used[u] >= l[2] and not per.fired[flag] then
        per.fired[flag] = true
        flags[#flags + 1] = flag
        flags[#flags + 1] = '1'
        redis.call('LPUSH', O, table.concat({u, l[1], int(per.used[u]), int(quota[u]), ARGV[2],
          period}, '|'))
        fired = fired + 1
      end
    end
  end
  if fired > 0 then
    redis.call('HSET', per.key, unpack(flags))
    redis.call('LTRIM', O, 0, 999)
  end
  return fired
end

local function expire_holds()
  local nx = tonumber(acct[2])
  if nx == nil or nx > now then return end
  local due = redis.call('ZRANGEBYSCORE', H, '-inf', ARGV[2], 'LIMIT', 0, 100)
  for _, rid in ipairs(due) do
    local rk = pfx .. 'r:' .. rid
    local raw = redis.call('GET', rk)
    if raw then
      local rec = split(raw, SEP)
      if rec[STATUS] == 'held' then
        local per = load_period(pfx .. 'p:' .. rec[PERIOD])
        give_back(per.exists and per or nil, decode_parts(rec[PARTS]), unit_amounts(rec))
        if per.exists then save_period(per, nil) end
        rec[STATUS], rec[PARTS] = 'expired', ''
        redis.call('SET', rk, table.concat(rec, SEP), 'KEEPTTL')
      end
    end
    redis.call('ZREM', H, rid)
  end
  local first = redis.call('ZRANGE', H, 0, 0, 'WITHSCORES')
  if first[2] then redis.call('HSET', A, 'nx', first[2]) else redis.call('HDEL', A, 'nx') end
  save_bonus()
end

local function record(raw, ttl)
  redis.call('SET', R, raw, 'EX', int(math.max(1, math.ceil(ttl))))
end

local function row(raw, max_rows)
  redis.call('XADD', S, 'MAXLEN', '~', max_rows, '*', 'id', ARGV[3], 'r', raw)
end

local function amounts_of(i, o, c)
  local a_in, a_out, a_calls = tonumber(i), tonumber(o), tonumber(c)
  return add_units({tokens = a_in + a_out, input_tokens = a_in, output_tokens = a_out,
    calls = a_calls}, UN)
end
local own = UN ~= '' and UN or nil  -- the record's 15th field

expire_holds()

if op == 'charge' or op == 'hold' then
  local rid, fp = ARGV[3], ARGV[4]
  local raw = redis.call('GET', R)
  if raw then
    local rec = split(raw, SEP)
    if rec[KIND] ~= op or rec[FP] ~= fp then return {'CONFLICT'} end
    return {'REPLAY', raw}
  end
  local am = amounts_of(ARGV[5], ARGV[6], ARGV[7])
  local per = load_period(P)
  local parts, unit, need, avail = take(per, am, false)
  if parts == nil then return {'QUOTA', unit, int(need), int(avail)} end
  local rec = {op, 'charged', fp, '', ARGV[2], pkey, ARGV[5], ARGV[6], ARGV[7], ARGV[8],
    ARGV[9], ARGV[10], '', '', own}
  if op == 'hold' then
    rec[STATUS], rec[EXP], rec[PARTS] = 'held', ARGV[11], encode_parts(parts)
    for _, u in ipairs(units) do per.held[u] = per.held[u] + (am[u] or 0) end
    redis.call('ZADD', H, ARGV[11], rid)
    if KEYS[7] then  -- the id -> account index (single server only: another slot)
      redis.call('SET', KEYS[7], ARGV[12], 'EX', int(math.ceil(tonumber(ARGV[11]) - now + retention)))
    end
    local nx = tonumber(acct[2])
    if nx == nil or tonumber(ARGV[11]) < nx then redis.call('HSET', A, 'nx', ARGV[11]) end
    record(table.concat(rec, SEP), tonumber(ARGV[11]) - now + retention)
  else
    local raw = table.concat(rec, SEP)
    record(raw, tonumber(pend) - now + retention)
    row(raw, MAXROWS)
  end
  local fired = fire(per, pkey)
  save_period(per, pend)
  save_bonus()
  return {'OK', fired}
end

if op == 'settle' then
  -- ARGV 4 is the settle fingerprint, 8 the model ('' = keep)
  local rid, sfp, model, max_rows = ARGV[3], ARGV[4], ARGV[8], MAXROWS
  local am = amounts_of(ARGV[5], ARGV[6], ARGV[7])
  local raw = redis.call('GET', R)
  local rec = raw and split(raw, SEP)
  if rec and rec[STATUS] == 'charged' then
    local same = rec[IN] == ARGV[5] and rec[OUT] == ARGV[6] and rec[CALLS] == ARGV[7]
      and (model == '' or model == rec[MODEL]) and (rec[UNITS] or '') == UN
    if rec[SFP] ~= sfp and not (rec[KIND] == 'charge' and same) then return {'CONFLICT'} end
    return {'REPLAY', raw}
  end
  local per, period
  if not rec then
    per, period = load_period(P), pkey
    rec = {'charge', 'charged', sfp, sfp, ARGV[2], pkey, '', '', '', model, '', '', '', '', own}
  else
    period = rec[PERIOD]
    per = load_period(pfx .. 'p:' .. period)
    if rec[STATUS] == 'held' then
      give_back(per.exists and per or nil, decode_parts(rec[PARTS]), unit_amounts(rec))
      redis.call('ZREM', H, rid)
    end
    if not per.exists then per, period = load_period(P), pkey end
    if model == '' then model = rec[MODEL] end
  end
  take(per, am, true)
  rec[STATUS], rec[SFP], rec[AT], rec[PERIOD] = 'charged', sfp, ARGV[2], period
  rec[IN], rec[OUT], rec[CALLS], rec[MODEL], rec[PARTS], rec[UNITS] =
    ARGV[5], ARGV[6], ARGV[7], model, '', own
  local out = table.concat(rec, SEP)
  record(out, (period == pkey and tonumber(pend) or now) - now + retention)
  row(out, max_rows)
  local fired = fire(per, period)
  save_period(per, period == pkey and pend or nil)
  save_bonus()
  return {'OK', fired, out}
end

if op == 'release' then
  local raw = redis.call('GET', R)
  if not raw then return {'OK', 0} end
  local rec = split(raw, SEP)
  if rec[STATUS] ~= 'held' then return {'OK', 0} end
  local per = load_period(pfx .. 'p:' .. rec[PERIOD])
  give_back(per.exists and per or nil, decode_parts(rec[PARTS]), unit_amounts(rec))
  if per.exists then save_period(per, nil) end
  save_bonus()
  rec[STATUS], rec[PARTS] = 'released', ''
  redis.call('SET', R, table.concat(rec, SEP), 'KEEPTTL')
  redis.call('ZREM', H, ARGV[3])
  return {'OK', 1}
end

if op == 'balance' then
  local per = load_period(P)
  local out = {'OK'}
  for _, u in ipairs(units) do
    out[#out + 1] = int(per.used[u])
    out[#out + 1] = int(per.held[u])
    out[#out + 1] = int(bonus[u])
  end
  return out
end

if op == 'comp' then
  -- R is the account's audit hash; ARGV 3 campaign, 4 reset 0/1,
  -- 5 "unit=credit=bonus,...", 6 account
  local campaign = ARGV[3]
  local done = redis.call('HGET', R, campaign)
  if done then return {'DONE', done} end
  local per = load_period(P)
  local before_used, before_bonus, after_used, after_bonus, added = {}, {}, {}, {}, {}
  for _, spec in ipairs(split(ARGV[5], ',')) do
    local u, credit, add = string.match(spec, '^([^=]+)=(%d+)=(%d+)$')
    local used = math.max(0, per.used[u])
    local new_used = used
    if ARGV[4] == '1' then new_used = 0 end
    if tonumber(credit) > 0 then new_used = math.max(0, used - tonumber(credit)) end
    per.used[u] = new_used
    before_used[u], before_bonus[u] = int(used), int(bonus[u])
    bonus[u] = bonus[u] + tonumber(add)
    bonus_delta[u] = (bonus_delta[u] or 0) + tonumber(add)
    after_used[u], after_bonus[u] = int(new_used), int(bonus[u])
    added[u] = add
  end
  save_period(per, pend)
  save_bonus()
  local rec = cjson.encode({account = ARGV[6], campaign = campaign, period = pkey,
    status = 'changed', at = ARGV[2],
    before = {used = before_used, bonus = before_bonus},
    after = {used = after_used, bonus = after_bonus}, bonus_added = added})
  redis.call('HSET', R, campaign, rec)
  return {'OK', rec}
end

return redis.error_reply('unknown ledger op ' .. tostring(op))
