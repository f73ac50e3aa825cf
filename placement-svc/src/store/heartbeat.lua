-- Applies one heartbeat atomically: the Redis twin of core::account::NodeView::apply_heartbeat.
--
-- KEYS: node hash, reservations hash, removals hash, listed set, the set of all node ids.
-- ARGV: node_id, boot_id, seq, now_ms, address, labels (JSON), cap_vcpus, cap_mem,
--       alloc_vcpus, alloc_mem, mem_used, cpu_usage, mode, max_unconfirmed, templates (the
--       build IDs the node holds, as ",id,id,": place.lua looks one up with a plain find),
--       pool_vcpus, pool_mem (what its pooled sandboxes hold), max_pending_ms, then sandbox
--       ids.
--
-- A reservation is `vcpus,memory,phase,n`: `p` (pending) with n the placer's clock (ms) at
-- Place, or `u` (unconfirmed) with n the heartbeats that have not listed it since. One made
-- by a placer older than pending expiry (during a rolling upgrade) reads `p,0`: its clock
-- starts at this heartbeat, as NodeView::apply_heartbeat's does.
-- Returns: { applied (0/1), reason, confirmed, removed, rebooted (0/1), draining (0/1),
--            expired ids... }
--
-- Numbers: Lua's own number-to-text conversion (`..`, tostring) keeps 14 significant digits
-- and switches to exponent notation from 1e14 on, which neither these scripts nor the Redis
-- store's reader parse back; every number written goes through `int` instead. Arithmetic on
-- resources is exact up to 2^53 (a Lua number is a double). Sequence numbers are u64 and are
-- compared as decimal text, never as numbers.
--
-- Redis does not undo a script's writes when it fails halfway, so everything that can fail
-- (parsing what is stored) happens before the first write.
local node, res_key, rm_key, listed_key, all_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]

-- An integral number as plain decimal digits ('0', never '-0', which HINCRBY rejects).
local function int(x)
  if x == 0 then return '0' end
  return string.format('%.0f', x)
end

-- Whether the decimal integer text `a` is greater than `b` (both as Rust writes a u64: digits,
-- no leading zeros). Compared in two parts of at most 10 digits, each exact as a double.
local function greater(a, b)
  if #a ~= #b then return #a > #b end
  local high_a, high_b = tonumber(string.sub(a, 1, -11)) or 0, tonumber(string.sub(b, 1, -11)) or 0
  if high_a ~= high_b then return high_a > high_b end
  return tonumber(string.sub(a, -10)) > tonumber(string.sub(b, -10))
end

local boot, applied_seq, admin = unpack(redis.call('HMGET', node, 'boot', 'seq', 'admin'))
local draining = 0
if admin == 'draining' then draining = 1 end
local rebooted = 0
if boot == ARGV[2] then
  applied_seq = applied_seq or '0'
  if not greater(ARGV[3], applied_seq) then
    -- Ignored, but like the Rust core it still says whether the node is draining.
    return { 0, 'sequence ' .. ARGV[3] .. ' of boot ' .. ARGV[2] .. ' is not newer than ' .. applied_seq ..
      ' already applied', 0, 0, 0, draining }
  end
elseif boot then
  rebooted = 1
end
local first_id = 19
local reconciled = ARGV[13] == 'reconciled'

-- Reconciled accounting: read and parse the reservations and removals before writing anything.
local listed = {}
local reservations, removals = {}, {}
if reconciled then
  for i = first_id, #ARGV do listed[ARGV[i]] = true end
  local res = redis.call('HGETALL', res_key)
  for i = 1, #res, 2 do
    local v, m, phase, unlisted = string.match(res[i + 1], '^(%d+),(%d+),([pu]),(%d+)$')
    if not v then
      return redis.error_reply('ERR malformed reservation ' .. res[i] .. ' in ' .. res_key .. ': ' .. res[i + 1])
    end
    table.insert(reservations, { res[i], tonumber(v), tonumber(m), phase, tonumber(unlisted) })
  end
  local rms = redis.call('HGETALL', rm_key)
  for i = 1, #rms, 2 do
    local v, m = string.match(rms[i + 1], '^(%d+),(%d+)$')
    if not v then
      return redis.error_reply('ERR malformed removal ' .. rms[i] .. ' in ' .. rm_key .. ': ' .. rms[i + 1])
    end
    table.insert(removals, { rms[i], tonumber(v), tonumber(m) })
  end
end

redis.call('SADD', all_key, ARGV[1])
if not admin then redis.call('HSET', node, 'admin', 'ready') end
redis.call('HSET', node, 'node_id', ARGV[1], 'boot', ARGV[2], 'seq', ARGV[3], 'hb_ms', ARGV[4],
  'address', ARGV[5], 'labels', ARGV[6], 'cap_vcpus', ARGV[7], 'cap_mem', ARGV[8],
  'rep_vcpus', ARGV[9], 'rep_mem', ARGV[10], 'rep_sbx', int(#ARGV - first_id + 1),
  'mem_used', ARGV[11], 'cpu_usage', ARGV[12], 'templates', ARGV[15], 'pool_vcpus', ARGV[16],
  'pool_mem', ARGV[17])
if not reconciled then
  return { 1, '', 0, 0, rebooted, draining }
end
local max_unconfirmed = tonumber(ARGV[14])
local max_pending_ms = tonumber(ARGV[18])
local now = tonumber(ARGV[4])
redis.call('DEL', listed_key)
local batch = {}
for i = first_id, #ARGV do
  table.insert(batch, ARGV[i])
  if #batch == 1000 then
    redis.call('SADD', listed_key, unpack(batch))
    batch = {}
  end
end
if #batch > 0 then redis.call('SADD', listed_key, unpack(batch)) end

local confirmed, removed = 0, 0
local expired = {}
local res_v, res_m, pending, unconfirmed = 0, 0, 0, 0
for _, r in ipairs(reservations) do
  local id, v, m, phase, unlisted = r[1], r[2], r[3], r[4], r[5]
  if listed[id] then
    redis.call('HDEL', res_key, id)
    confirmed = confirmed + 1
  elseif phase == 'u' then
    unlisted = unlisted + 1
    if unlisted > max_unconfirmed then
      redis.call('HDEL', res_key, id)
      table.insert(expired, id)
    else
      redis.call('HSET', res_key, id, int(v) .. ',' .. int(m) .. ',u,' .. int(unlisted))
      res_v, res_m, unconfirmed = res_v + v, res_m + m, unconfirmed + 1
    end
  elseif unlisted == 0 then
    redis.call('HSET', res_key, id, int(v) .. ',' .. int(m) .. ',p,' .. int(now))
    res_v, res_m, pending = res_v + v, res_m + m, pending + 1
  elseif now - unlisted > max_pending_ms then
    -- Pending since `unlisted` (ms): a create whose Created or Release was lost.
    redis.call('HDEL', res_key, id)
    table.insert(expired, id)
  else
    res_v, res_m, pending = res_v + v, res_m + m, pending + 1
  end
end
local rm_v, rm_m = 0, 0
for _, r in ipairs(removals) do
  local id, v, m = r[1], r[2], r[3]
  if listed[id] then
    rm_v, rm_m = rm_v + v, rm_m + m
  else
    redis.call('HDEL', rm_key, id)
    removed = removed + 1
  end
end
redis.call('HSET', node, 'res_vcpus', int(res_v), 'res_mem', int(res_m), 'pending', int(pending),
  'unconfirmed', int(unconfirmed), 'rm_vcpus', int(rm_v), 'rm_mem', int(rm_m))
local result = { 1, '', confirmed, removed, rebooted, draining }
for _, id in ipairs(expired) do table.insert(result, id) end
return result
