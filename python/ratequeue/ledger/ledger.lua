-- ratequeue quota ledger: one account's idempotency check, deduction and threshold
-- crossing, atomically, in one round trip. Every key shares the account's hash tag.
--
-- KEYS: 1 account hash, 2 request hash (or audit hash for "comp"), 3 hold expiry zset,
--       4 usage rows stream, 5 outbox list, 6 current period hash
-- ARGV: 1 op, 2 now, 3 plan version, 4 key prefix, 5 retention s, 6 period key,
--       7 period end, 8 quota "u=q,...", 9 thresholds "u:bp:level,...", then per op.

local A, R, H, S, O, P = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local op, now, ver, pfx = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4]
local retention, pkey, pend = tonumber(ARGV[5]), ARGV[6], tonumber(ARGV[7])

local function split(s, sep)
  local out = {}
  if s == nil or s == '' then return out end
  for part in string.gmatch(s, '([^' .. sep .. ']+)') do out[#out + 1] = part end
  return out
end

local quota, units = {}, {}
for _, kv in ipairs(split(ARGV[8], ',')) do
  local u, q = string.match(kv, '^([^=]+)=(%d+)$')
  quota[u] = tonumber(q)
  units[#units + 1] = u
end
local thresholds = {}
for _, t in ipairs(split(ARGV[9], ',')) do
  local u, bp, level = string.match(t, '^([^:]+):(%d+):(%d+)$')
  thresholds[#thresholds + 1] = {u, bp, tonumber(level)}
end

local function num(v) return tonumber(v) or 0 end
-- Integers go to Redis as %d text: exact below 2**53 (the client refuses larger).
local function int(x) return string.format('%d', x) end

local function encode_parts(parts)
  local out = {}
  for u, pb in pairs(parts) do out[#out + 1] = u .. ':' .. int(pb[1]) .. ':' .. int(pb[2]) end
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

local function ttl_for(end_time)
  return math.max(1, math.ceil(end_time - now + retention))
end

-- Give a hold's parts back: its plan part to its period, its bonus part to the bonus.
local function give_back(pk, parts)
  local alive = redis.call('EXISTS', pk) == 1
  for u, pb in pairs(parts) do
    if alive then
      local used = num(redis.call('HGET', pk, 'u_' .. u))
      redis.call('HSET', pk, 'u_' .. u, int(math.max(0, used - pb[1])))
    end
    if pb[2] > 0 then redis.call('HINCRBY', A, 'b_' .. u, int(pb[2])) end
  end
end

local function hold_delta(pk, rec_in, rec_out, rec_calls, sign)
  if redis.call('EXISTS', pk) == 0 then return end
  local d = {tokens = rec_in + rec_out, input_tokens = rec_in, output_tokens = rec_out,
             calls = rec_calls}
  for u, v in pairs(d) do
    local cur = num(redis.call('HGET', pk, 'h_' .. u))
    redis.call('HSET', pk, 'h_' .. u, int(math.max(0, cur + sign * v)))
  end
end

local function expire_holds()
  local due = redis.call('ZRANGEBYSCORE', H, '-inf', now, 'LIMIT', 0, 100)
  for _, rid in ipairs(due) do
    local rk = pfx .. 'r:' .. rid
    local f = redis.call('HMGET', rk, 'status', 'period', 'parts', 'in', 'out', 'calls')
    if f[1] == 'held' then
      local pk = pfx .. 'p:' .. f[2]
      give_back(pk, decode_parts(f[3]))
      hold_delta(pk, num(f[4]), num(f[5]), num(f[6]), -1)
      redis.call('HSET', rk, 'status', 'expired')
      redis.call('HDEL', rk, 'parts')
    end
    redis.call('ZREM', H, rid)
  end
end

-- Take amounts from the plan quota then the bonus; with force, past the quota.
-- Returns parts, or nil, unit, need, available when it does not fit.
local function take(pk, am, force)
  local parts = {}
  for _, u in ipairs(units) do
    local need = am[u]
    local used = num(redis.call('HGET', pk, 'u_' .. u))
    local bonus = num(redis.call('HGET', A, 'b_' .. u))
    local free = math.max(0, quota[u] - used)
    local fp = math.min(need, free)
    local fb = math.min(need - fp, bonus)
    if not force and fp + fb < need then
      return nil, u, need, free + bonus
    end
    if force then fp = need - fb end
    parts[u] = {fp, fb}
  end
  for u, pb in pairs(parts) do
    if pb[1] ~= 0 then redis.call('HINCRBY', pk, 'u_' .. u, int(pb[1])) end
    if pb[2] ~= 0 then redis.call('HINCRBY', A, 'b_' .. u, int(-pb[2])) end
  end
  return parts
end

-- Fire each threshold once per period: HSETNX is the exactly-once flag.
local function fire(pk, period, at)
  local fired = 0
  for _, t in ipairs(thresholds) do
    local u, bp, level = t[1], t[2], t[3]
    local used = num(redis.call('HGET', pk, 'u_' .. u))
    if used >= level and redis.call('HSETNX', pk, 'f:' .. u .. ':' .. bp, 1) == 1 then
      redis.call('LPUSH', O, table.concat({u, bp, int(used), int(quota[u]), ARGV[2], period}, '|'))
      redis.call('LTRIM', O, 0, 999)
      fired = fired + 1
    end
  end
  return fired
end

local function touch_period(pk, end_time)
  if redis.call('EXISTS', pk) == 0 then
    redis.call('HSET', pk, 'end', int(end_time))
  end
  redis.call('EXPIRE', pk, int(ttl_for(end_time)))
end

local function row(rid, parent, period, a_in, a_out, a_calls, model, meta, max_rows)
  redis.call('XADD', S, 'MAXLEN', '~', max_rows, '*', 'id', rid, 'parent', parent,
    'at', ARGV[2], 'period', period, 'in', int(a_in), 'out', int(a_out), 'calls', int(a_calls),
    'model', model, 'meta', meta)
end

local function amounts(i, o, c)
  local a_in, a_out, a_calls = tonumber(i), tonumber(o), tonumber(c)
  return {tokens = a_in + a_out, input_tokens = a_in, output_tokens = a_out, calls = a_calls},
    a_in, a_out, a_calls
end

if redis.call('HGET', A, 'ver') ~= ver then
  return {'STALE'}
end
expire_holds()

if op == 'charge' or op == 'hold' then
  local rid, fp = ARGV[10], ARGV[11]
  local old = redis.call('HMGET', R, 'kind', 'fp', 'status', 'at', 'period', 'in', 'out',
    'calls', 'model', 'parent', 'meta', 'exp')
  if old[1] then
    if old[1] ~= op or old[2] ~= fp then return {'CONFLICT'} end
    return {'REPLAY', old[3], old[4], old[5], old[6], old[7], old[8], old[9] or '',
            old[10] or '', old[11] or '', old[12] or ''}
  end
  local am, a_in, a_out, a_calls = amounts(ARGV[12], ARGV[13], ARGV[14])
  touch_period(P, pend)
  local parts, unit, need, avail = take(P, am, false)
  if parts == nil then return {'QUOTA', unit, tostring(need), tostring(avail)} end
  local fired = fire(P, pkey, now)
  local model, parent, meta = ARGV[15], ARGV[16], ARGV[17]
  redis.call('HSET', R, 'kind', op, 'fp', fp, 'at', ARGV[2], 'period', pkey, 'in', int(a_in),
    'out', int(a_out), 'calls', int(a_calls), 'model', model, 'parent', parent, 'meta', meta)
  if op == 'hold' then
    redis.call('HSET', R, 'status', 'held', 'parts', encode_parts(parts), 'exp', ARGV[18])
    redis.call('ZADD', H, ARGV[18], rid)
    hold_delta(P, a_in, a_out, a_calls, 1)
    redis.call('EXPIRE', R, int(math.ceil(tonumber(ARGV[18]) - now + retention)))
  else
    redis.call('HSET', R, 'status', 'charged')
    row(rid, parent, pkey, a_in, a_out, a_calls, model, meta, ARGV[19])
    redis.call('EXPIRE', R, int(math.ceil(retention)))
  end
  return {'OK', fired}
end

if op == 'settle' then
  local rid, sfp = ARGV[10], ARGV[11]
  local am, a_in, a_out, a_calls = amounts(ARGV[12], ARGV[13], ARGV[14])
  local model, max_rows = ARGV[15], ARGV[19]
  local old = redis.call('HMGET', R, 'kind', 'status', 'sfp', 'period', 'parts', 'in', 'out',
    'calls', 'model', 'parent', 'meta', 'at')
  if old[2] == 'charged' then
    local same = tonumber(old[6]) == a_in and tonumber(old[7]) == a_out
      and tonumber(old[8]) == a_calls and (model == '' or model == old[9])
    if old[3] ~= sfp and not (old[1] == 'charge' and same) then return {'CONFLICT'} end
    return {'REPLAY', old[2], old[12], old[4], old[6], old[7], old[8], old[9] or '',
            old[10] or '', old[11] or '', ''}
  end
  local fired = 0
  if not old[1] then
    touch_period(P, pend)
    take(P, am, true)
    fired = fire(P, pkey, now)
    redis.call('HSET', R, 'kind', 'charge', 'status', 'charged', 'fp', sfp, 'sfp', sfp,
      'at', ARGV[2], 'period', pkey, 'in', int(a_in), 'out', int(a_out), 'calls', int(a_calls),
      'model', model, 'parent', '', 'meta', '')
    row(rid, '', pkey, a_in, a_out, a_calls, model, '', max_rows)
    redis.call('EXPIRE', R, int(math.ceil(retention)))
    return {'OK', fired, pkey, model, '', ''}
  end
  local period = old[4]
  local pk = pfx .. 'p:' .. period
  if old[2] == 'held' then
    give_back(pk, decode_parts(old[5]))
    hold_delta(pk, num(old[6]), num(old[7]), num(old[8]), -1)
    redis.call('ZREM', H, rid)
  end
  if redis.call('EXISTS', pk) == 0 then
    pk, period = P, pkey
    touch_period(P, pend)
  end
  take(pk, am, true)
  fired = fire(pk, period, now)
  if model == '' then model = old[9] or '' end
  redis.call('HSET', R, 'status', 'charged', 'sfp', sfp, 'at', ARGV[2], 'period', period,
    'in', int(a_in), 'out', int(a_out), 'calls', int(a_calls), 'model', model)
  redis.call('HDEL', R, 'parts')
  redis.call('EXPIRE', R, int(math.ceil(retention)))
  row(rid, old[10] or '', period, a_in, a_out, a_calls, model, old[11] or '', max_rows)
  return {'OK', fired, period, model, old[10] or '', old[11] or ''}
end

if op == 'release' then
  local f = redis.call('HMGET', R, 'status', 'period', 'parts', 'in', 'out', 'calls')
  if f[1] == 'held' then
    local pk = pfx .. 'p:' .. f[2]
    give_back(pk, decode_parts(f[3]))
    hold_delta(pk, num(f[4]), num(f[5]), num(f[6]), -1)
    redis.call('HSET', R, 'status', 'released')
    redis.call('HDEL', R, 'parts')
    redis.call('ZREM', H, ARGV[10])
    return {'OK', 1}
  end
  return {'OK', 0}
end

if op == 'balance' then
  touch_period(P, pend)
  local out = {'OK'}
  for _, u in ipairs(units) do
    out[#out + 1] = redis.call('HGET', P, 'u_' .. u) or '0'
    out[#out + 1] = redis.call('HGET', P, 'h_' .. u) or '0'
    out[#out + 1] = redis.call('HGET', A, 'b_' .. u) or '0'
  end
  return out
end

if op == 'comp' then
  -- R is the account's audit hash; ARGV 10 campaign, 11 reset 0/1, 12 "u=credit=bonus,..."
  local campaign = ARGV[10]
  local done = redis.call('HGET', R, campaign)
  if done then return {'DONE', done} end
  touch_period(P, pend)
  local before_used, before_bonus, after_used, after_bonus, added = {}, {}, {}, {}, {}
  for _, spec in ipairs(split(ARGV[12], ',')) do
    local u, credit, bonus = string.match(spec, '^([^=]+)=(%d+)=(%d+)$')
    local used = math.max(0, num(redis.call('HGET', P, 'u_' .. u)))
    local b = num(redis.call('HGET', A, 'b_' .. u))
    local new_used = used
    if ARGV[11] == '1' then new_used = 0 end
    if tonumber(credit) > 0 then new_used = math.max(0, used - tonumber(credit)) end
    redis.call('HSET', P, 'u_' .. u, int(new_used))
    redis.call('HINCRBY', A, 'b_' .. u, bonus)
    before_used[u], before_bonus[u] = int(used), int(b)
    after_used[u], after_bonus[u] = int(new_used), int(b + tonumber(bonus))
    added[u] = bonus
  end
  local rec = cjson.encode({account = ARGV[13], campaign = campaign, period = pkey,
    status = 'changed', at = ARGV[2],
    before = {used = before_used, bonus = before_bonus},
    after = {used = after_used, bonus = after_bonus}, bonus_added = added})
  redis.call('HSET', R, campaign, rec)
  return {'OK', rec}
end

return redis.error_reply('unknown ledger op ' .. tostring(op))
