-- Applies one heartbeat atomically: the Redis twin of core::account::NodeView::apply_heartbeat.
--
-- KEYS: node hash, reservations hash, removals hash, listed set, the set of all node ids.
-- ARGV: node_id, boot_id, seq, now_ms, address, labels (JSON), cap_vcpus, cap_mem,
--       alloc_vcpus, alloc_mem, mem_used, cpu_usage, mode, max_unconfirmed, then sandbox ids.
-- Returns: { applied (0/1), reason, confirmed, removed, rebooted (0/1), expired ids... }
local node, res_key, rm_key, listed_key, all_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local boot = redis.call('HGET', node, 'boot')
local seq = tonumber(redis.call('HGET', node, 'seq') or '0') or 0
local rebooted = 0
if boot == ARGV[2] then
  if tonumber(ARGV[3]) <= seq then
    return { 0, 'sequence ' .. ARGV[3] .. ' of boot ' .. ARGV[2] .. ' is not newer than ' .. seq .. ' already applied', 0, 0, 0 }
  end
elseif boot then
  rebooted = 1
end
local first_id = 15
redis.call('SADD', all_key, ARGV[1])
redis.call('HSETNX', node, 'admin', 'ready')
local draining = 0
if redis.call('HGET', node, 'admin') == 'draining' then draining = 1 end
redis.call('HSET', node, 'node_id', ARGV[1], 'boot', ARGV[2], 'seq', ARGV[3], 'hb_ms', ARGV[4],
  'address', ARGV[5], 'labels', ARGV[6], 'cap_vcpus', ARGV[7], 'cap_mem', ARGV[8],
  'rep_vcpus', ARGV[9], 'rep_mem', ARGV[10], 'rep_sbx', #ARGV - first_id + 1,
  'mem_used', ARGV[11], 'cpu_usage', ARGV[12])
if ARGV[13] ~= 'reconciled' then
  return { 1, '', 0, 0, rebooted, draining }
end
local max_unconfirmed = tonumber(ARGV[14])
local listed = {}
redis.call('DEL', listed_key)
local batch = {}
for i = first_id, #ARGV do
  listed[ARGV[i]] = true
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
local res = redis.call('HGETALL', res_key)
for i = 1, #res, 2 do
  local id = res[i]
  local v, m, phase, unlisted = string.match(res[i + 1], '^(%d+),(%d+),(%a),(%d+)$')
  v, m, unlisted = tonumber(v), tonumber(m), tonumber(unlisted)
  if listed[id] then
    redis.call('HDEL', res_key, id)
    confirmed = confirmed + 1
  elseif phase == 'u' then
    unlisted = unlisted + 1
    if unlisted > max_unconfirmed then
      redis.call('HDEL', res_key, id)
      table.insert(expired, id)
    else
      redis.call('HSET', res_key, id, v .. ',' .. m .. ',u,' .. unlisted)
      res_v, res_m, unconfirmed = res_v + v, res_m + m, unconfirmed + 1
    end
  else
    res_v, res_m, pending = res_v + v, res_m + m, pending + 1
  end
end
local rm_v, rm_m = 0, 0
local rms = redis.call('HGETALL', rm_key)
for i = 1, #rms, 2 do
  local id = rms[i]
  if listed[id] then
    local v, m = string.match(rms[i + 1], '^(%d+),(%d+)$')
    rm_v, rm_m = rm_v + tonumber(v), rm_m + tonumber(m)
  else
    redis.call('HDEL', rm_key, id)
    removed = removed + 1
  end
end
redis.call('HSET', node, 'res_vcpus', res_v, 'res_mem', res_m, 'pending', pending,
  'unconfirmed', unconfirmed, 'rm_vcpus', rm_v, 'rm_mem', rm_m)
local result = { 1, '', confirmed, removed, rebooted, draining }
for _, id in ipairs(expired) do table.insert(result, id) end
return result
