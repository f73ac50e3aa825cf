-- Choose-and-reserve, atomically: the Redis twin of core::rank::Ranker::decide over a given
-- candidate order, plus NodeView::reserve. Keep the two in step (the store test suite runs the
-- same scenarios against both stores).
--
-- KEYS: for each candidate, its node hash then its reservations hash.
-- ARGV: sandbox_id, vcpus, memory_bytes, now_ms, overcommit, alpha, cpu_weight, memory_weight,
--       max_starting, unhealthy_after_ms, mode, k (stop after k feasible), commit (1: reserve
--       on the winner; 0: explain only), n (label pairs the node must carry), then n label
--       keys and values, then the node ids the request excludes.
-- Returns: { chosen (1-based candidate, 0 = none), chosen score, chosen address, then per
--            candidate looked at:
--            node_id, reason ("" if feasible), score, cpu term, memory term }
-- Scores and terms come back as integers in units of 1e-12: Redis turns a Lua number into an
-- integer reply for free, while formatting it as text costs more than the whole decision.
-- This runs on every Place, so it avoids JSON too: a node's labels are decoded only when the
-- request selects on labels.
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
local pairs_n = tonumber(ARGV[14])
local selector = {}
for j = 1, pairs_n do selector[ARGV[13 + 2 * j]] = ARGV[14 + 2 * j] end
local exclude = {}
for j = 15 + 2 * pairs_n, #ARGV do exclude[ARGV[j]] = true end
local SCALE = 1e12

local out = {}
local best, best_score, best_address, feasible = 0, 0, '', 0
local n = #KEYS / 2
for i = 1, n do
  local h = redis.call('HMGET', KEYS[2 * i - 1], 'node_id', 'admin', 'seq', 'hb_ms', 'labels',
    'cap_vcpus', 'cap_mem', 'rep_vcpus', 'rep_mem', 'res_vcpus', 'res_mem', 'rm_vcpus', 'rm_mem',
    'pending', 'cpu_usage', 'address')
  local id = h[1]
  local reason = ''
  local score, cpu, mem = 0, 0, 0
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
    if exclude[id] then
      reason = 'excluded by the request'
    elseif h[2] == 'draining' then
      reason = 'draining'
    elseif seq == 0 or age > unhealthy_after then
      reason = 'unhealthy: last heartbeat ' .. age .. ' ms ago'
    else
      local labels = pairs_n > 0 and cjson.decode(h[5] or '{}') or {}
      for key, value in pairs(selector) do
        if reason == '' and labels[key] ~= value then reason = 'label ' .. key .. '=' .. value .. ' missing' end
      end
      if reason == '' then
        local cpu_after = bel_v + req_v
        local mem_after = bel_m + req_m
        if cpu_after > cap_v * R then
          reason = 'cpu: ' .. cpu_after .. ' vCPU would exceed ' .. (cap_v * R)
        elseif mem_after > cap_m then
          reason = 'memory: ' .. math.floor(mem_after / 1048576) .. ' MiB would exceed ' .. math.floor(cap_m / 1048576) .. ' MiB'
        elseif pending >= max_starting then
          reason = 'too many starting: ' .. pending .. ' creates in flight'
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
      if cw ~= 0 then score = score + cw * cpu end
      if mw ~= 0 then score = score + mw * mem end
      feasible = feasible + 1
      if best == 0 or score < best_score then
        best, best_score, best_address = i, score, h[16] or ''
      end
    end
  end
  local o = #out
  out[o + 1] = id
  out[o + 2] = reason
  out[o + 3] = math.floor(score * SCALE + 0.5)
  out[o + 4] = math.floor(cpu * SCALE + 0.5)
  out[o + 5] = math.floor(mem * SCALE + 0.5)
  if feasible == k then break end
end

if commit and best > 0 and mode ~= 'stale' then
  local res = KEYS[2 * best]
  local node = KEYS[2 * best - 1]
  if redis.call('HEXISTS', res, sandbox) == 0 then
    redis.call('HSET', res, sandbox, req_v .. ',' .. req_m .. ',p,0')
    redis.call('HINCRBY', node, 'res_vcpus', req_v)
    redis.call('HINCRBY', node, 'res_mem', req_m)
    redis.call('HINCRBY', node, 'pending', 1)
  end
end
local result = { best, math.floor(best_score * SCALE + 0.5), best_address }
for j = 1, #out do result[3 + j] = out[j] end
return result
