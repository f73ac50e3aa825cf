-- Choose-and-reserve, atomically: the Redis twin of core::rank::Ranker::decide over a given
-- candidate order, plus NodeView::reserve. Keep the two in step (tests/store.rs runs the same
-- scenarios against both stores; tests/differential.rs compares them after random operations).
--
-- KEYS: for each candidate, its node hash then its reservations hash.
-- ARGV: sandbox_id, vcpus, memory_bytes, now_ms, overcommit, alpha, cpu_weight, memory_weight,
--       max_starting, unhealthy_after_ms, mode, k (stop after k feasible), commit (1: reserve
--       on the winner; 0: explain only), template (build ID, "" for none), template_weight,
--       reclaim (1: the nodes' pooled sandboxes' room counts as free), n (label pairs the
--       node must carry), then n label keys and values, then the node ids the request
--       excludes.
-- Returns: { chosen (1-based candidate, 0 = none), chosen score, chosen address, the vCPUs
--            and bytes of pooled sandboxes to retire on the chosen node first (as
--            core::rank::reclaim), then per candidate looked at:
--            node_id, reason ("" if feasible), score, cpu term, memory term, template term }
-- Scores and terms come back as integers in units of 1e-12: Redis turns a Lua number into an
-- integer reply for free, while formatting it as text costs more than the whole decision.
-- This runs on every Place, so it avoids JSON too: a node's labels are decoded only when the
-- request selects on labels.
--
-- Rejection reasons carry the same text as the Rust checks' (core::rank): figures are written
-- by `int` and `rust_float` below, never by Lua's own number-to-text conversion (`..`), which
-- keeps 14 significant digits and switches to exponent notation from 1e14 on. Resources are
-- exact up to 2^53 (a Lua number is a double).
local sandbox = ARGV[1]
local req_v = tonumber(ARGV[2])
local req_m = tonumber(ARGV[3])
local now = tonumber(ARGV[4])
local R = tonumber(ARGV[5])
local alpha = tonumber(ARGV[6])
local cw = tonumber(ARGV[7])
local mw = tonumber(ARGV[8])
local max_starting = tonumber(ARGV[9])
local unhealthy_after = tonumber(ARGV[10])
local mode = ARGV[11]
local k = tonumber(ARGV[12])
local commit = ARGV[13] == '1'
local template = ARGV[14]
local tw = tonumber(ARGV[15])
local reclaim = ARGV[16] == '1'
local pairs_n = tonumber(ARGV[17])
-- The selected labels are checked in the order they arrive, which is the request's key order
-- (a BTreeMap in Rust): the first missing one is the one named, as in the Rust check.
local selector = {}
for j = 1, pairs_n do selector[j] = { ARGV[16 + 2 * j], ARGV[17 + 2 * j] } end
local exclude = {}
for j = 18 + 2 * pairs_n, #ARGV do exclude[ARGV[j]] = true end
-- The delimited form the node's `templates` field holds it in.
local wanted = ',' .. template .. ','
local SCALE = 1e12

-- An integral number as plain decimal digits ('0', never '-0', which HINCRBY rejects).
local function int(x)
  if x == 0 then return '0' end
  return string.format('%.0f', x)
end

-- A number as Rust's `{}` writes an f64: the fewest significant digits that read back as the
-- same double (of those, the closest), never in exponent notation ("12", "4.5", "0.0000008",
-- "-0"). If some decimal of n digits reads back, the closest one of n digits does; 17 always do.
local function rust_float(x)
  if x ~= x then return 'NaN' end
  if x == math.huge then return 'inf' end
  if x == -math.huge then return '-inf' end
  local s
  for digits = 1, 17 do
    s = string.format('%.' .. (digits - 1) .. 'e', x)
    if tonumber(s) == x then break end
  end
  local sign, first, rest, exp = string.match(s, '^(-?)(%d)%.?(%d*)e([-+]%d+)$')
  local mantissa = string.gsub(first .. rest, '0+$', '')
  if mantissa == '' then return sign .. '0' end
  -- The value is 0.<mantissa> times 10^point.
  local point = tonumber(exp) + 1
  if point <= 0 then
    return sign .. '0.' .. string.rep('0', -point) .. mantissa
  elseif point >= #mantissa then
    return sign .. mantissa .. string.rep('0', point - #mantissa)
  end
  return sign .. string.sub(mantissa, 1, point) .. '.' .. string.sub(mantissa, point + 1)
end

local out = {}
local best, best_score, best_address, feasible = 0, 0, '', 0
-- What the winner lacks without its pooled sandboxes' room (core::rank::reclaim).
local best_short_v, best_short_m = 0, 0
local n = #KEYS / 2
for i = 1, n do
  local h = redis.call('HMGET', KEYS[2 * i - 1], 'node_id', 'admin', 'seq', 'hb_ms', 'labels',
    'cap_vcpus', 'cap_mem', 'rep_vcpus', 'rep_mem', 'res_vcpus', 'res_mem', 'rm_vcpus', 'rm_mem',
    'pending', 'cpu_usage', 'address', 'templates', 'pool_vcpus', 'pool_mem')
  local id = h[1]
  local reason = ''
  local score, cpu, mem, tpl, never = 0, 0, 0, 0, 0
  if not id then
    id = KEYS[2 * i - 1]
    reason = 'unknown node'
  else
    local seq = tonumber(h[3] or '0') or 0
    local age = now - (tonumber(h[4] or '0') or 0)
    if age < 0 then age = 0 end
    local cap_v = tonumber(h[6] or '0') or 0
    local cap_m = tonumber(h[7] or '0') or 0
    local bel_v = (tonumber(h[8] or '0') or 0) + (tonumber(h[10] or '0') or 0) - (tonumber(h[12] or '0') or 0)
    local bel_m = (tonumber(h[9] or '0') or 0) + (tonumber(h[11] or '0') or 0) - (tonumber(h[13] or '0') or 0)
    local pending = tonumber(h[14] or '0') or 0
    local usage = tonumber(h[15] or '0') or 0
    -- What the fit check counts (NodeView::allocation): the pooled room is free to reclaim.
    local fit_v, fit_m = bel_v, bel_m
    if reclaim then
      fit_v = bel_v - (tonumber(h[18] or '0') or 0)
      fit_m = bel_m - (tonumber(h[19] or '0') or 0)
    end
    local short_v, short_m = 0, 0
    if exclude[id] then
      reason = 'excluded by the request'
    elseif h[2] == 'draining' then
      reason = 'draining'
    elseif seq == 0 or age > unhealthy_after then
      reason = 'unhealthy: last heartbeat ' .. int(age) .. ' ms ago'
    else
      local labels = pairs_n > 0 and cjson.decode(h[5] or '{}') or {}
      for j = 1, pairs_n do
        local key, value = selector[j][1], selector[j][2]
        if labels[key] ~= value then
          reason = 'label ' .. key .. '=' .. value .. ' missing'
          break
        end
      end
      if reason == '' then
        local cpu_after = fit_v + req_v
        local cpu_limit = cap_v * R
        local mem_after = fit_m + req_m
        -- Too large even for this node empty (the same text as core::rank::Fits).
        if req_v > cpu_limit then
          reason = 'too large for this node: cpu: ' .. rust_float(req_v) .. ' vCPU would exceed ' ..
            rust_float(cpu_limit) .. ' (R=' .. rust_float(R) .. ')'
          never = 1
        elseif req_m > cap_m then
          reason = 'too large for this node: memory: ' .. int(math.floor(req_m / 1048576)) ..
            ' MiB would exceed ' .. int(math.floor(cap_m / 1048576)) .. ' MiB'
          never = 1
        elseif cpu_after > cpu_limit then
          reason = 'cpu: ' .. rust_float(cpu_after) .. ' vCPU would exceed ' .. rust_float(cpu_limit) ..
            ' (R=' .. rust_float(R) .. ')'
        elseif mem_after > cap_m then
          reason = 'memory: ' .. int(math.floor(mem_after / 1048576)) .. ' MiB would exceed ' ..
            int(math.floor(cap_m / 1048576)) .. ' MiB'
        elseif pending >= max_starting then
          reason = 'too many starting: ' .. int(pending) .. ' creates in flight'
        elseif reclaim then
          short_v = math.max(math.ceil(bel_v + req_v - cpu_limit), 0)
          short_m = math.max(bel_m + req_m - cap_m, 0)
        end
      end
    end
    if reason == '' then
      local cap_vc = cap_v
      if cap_vc < 1 then cap_vc = 1 end
      local cap_mc = cap_m
      if cap_mc < 1 then cap_mc = 1 end
      cpu = (req_v + bel_v + alpha * usage) / (cap_vc * R)
      mem = (req_m + bel_m) / cap_mc
      -- As core::rank::TemplateAffinity: 1 when the node lacks the template's layers.
      if template ~= '' and not string.find(h[17] or '', wanted, 1, true) then tpl = 1 end
      if cw ~= 0 then score = score + cw * cpu end
      if mw ~= 0 then score = score + mw * mem end
      if tw ~= 0 then score = score + tw * tpl end
      feasible = feasible + 1
      if best == 0 or score < best_score then
        best, best_score, best_address = i, score, h[16] or ''
        best_short_v, best_short_m = short_v, short_m
      end
    end
  end
  local o = #out
  out[o + 1] = id
  out[o + 2] = reason
  out[o + 3] = math.floor(score * SCALE + 0.5)
  out[o + 4] = math.floor(cpu * SCALE + 0.5)
  out[o + 5] = math.floor(mem * SCALE + 0.5)
  out[o + 6] = tpl
  out[o + 7] = never
  if feasible == k then break end
end

if commit and best > 0 and mode ~= 'stale' then
  -- As NodeView::reserve: a new pending reservation, replacing any the sandbox ID holds on this
  -- node (a retried Place); the running totals trade the old one for the new one. The old one
  -- is parsed before anything is written.
  local res = KEYS[2 * best]
  local node = KEYS[2 * best - 1]
  local old_v, old_m, old_phase = 0, 0, nil
  local old = redis.call('HGET', res, sandbox)
  if old then
    old_v, old_m, old_phase = string.match(old, '^(%d+),(%d+),([pu]),%d+$')
    if not old_v then
      return redis.error_reply('ERR malformed reservation ' .. sandbox .. ' in ' .. res .. ': ' .. old)
    end
    old_v, old_m = tonumber(old_v), tonumber(old_m)
  end
  -- A pending reservation's last field is when it was made (heartbeat.lua expires it).
  redis.call('HSET', res, sandbox, int(req_v) .. ',' .. int(req_m) .. ',p,' .. int(now))
  -- As NodeView::promise_pooled: the pooled room this create reclaims is no other's to count
  -- on until the next heartbeat.
  if best_short_v > 0 or best_short_m > 0 then
    local pv, pm = unpack(redis.call('HMGET', node, 'pool_vcpus', 'pool_mem'))
    redis.call('HSET', node, 'pool_vcpus', int(math.max((tonumber(pv or '0') or 0) - best_short_v, 0)),
      'pool_mem', int(math.max((tonumber(pm or '0') or 0) - best_short_m, 0)))
  end
  if req_v ~= old_v then redis.call('HINCRBY', node, 'res_vcpus', int(req_v - old_v)) end
  if req_m ~= old_m then redis.call('HINCRBY', node, 'res_mem', int(req_m - old_m)) end
  if old_phase ~= 'p' then
    redis.call('HINCRBY', node, 'pending', 1)
    if old_phase == 'u' then redis.call('HINCRBY', node, 'unconfirmed', -1) end
  end
end
local result = { best, math.floor(best_score * SCALE + 0.5), best_address, best_short_v, best_short_m }
for j = 1, #out do result[5 + j] = out[j] end
return result
