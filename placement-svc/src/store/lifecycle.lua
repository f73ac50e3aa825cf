-- A reservation's life after Place, atomically: the Redis twin of NodeView::created,
-- ::release and ::removed.
--
-- KEYS: node hash, reservations hash, removals hash, listed set.
-- ARGV: op (created | release | removed), sandbox_id, mode, vcpus, memory_bytes (what the
--       sandbox held, for removed without a reservation)
-- Returns: 1, or 0 when the node is unknown.
local node, res_key, rm_key, listed_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local op, sandbox, mode = ARGV[1], ARGV[2], ARGV[3]
if redis.call('EXISTS', node) == 0 then return 0 end
if mode == 'stale' then return 1 end

-- Drops the reservation, if any, and returns what it held and its phase.
local function take()
  local val = redis.call('HGET', res_key, sandbox)
  if not val then return nil end
  local v, m, phase = string.match(val, '^(%d+),(%d+),(%a),')
  v, m = tonumber(v), tonumber(m)
  redis.call('HDEL', res_key, sandbox)
  redis.call('HINCRBY', node, 'res_vcpus', -v)
  redis.call('HINCRBY', node, 'res_mem', -m)
  if phase == 'p' then
    redis.call('HINCRBY', node, 'pending', -1)
  else
    redis.call('HINCRBY', node, 'unconfirmed', -1)
  end
  return v, m, phase
end

if op == 'created' then
  if mode == 'optimistic' then
    local v, m = take()
    if v then
      redis.call('HINCRBY', node, 'rep_vcpus', v)
      redis.call('HINCRBY', node, 'rep_mem', m)
    end
  else
    local val = redis.call('HGET', res_key, sandbox)
    if val then
      local v, m, phase = string.match(val, '^(%d+),(%d+),(%a),')
      if phase == 'p' then
        redis.call('HSET', res_key, sandbox, v .. ',' .. m .. ',u,0')
        redis.call('HINCRBY', node, 'pending', -1)
        redis.call('HINCRBY', node, 'unconfirmed', 1)
      end
    end
  end
elseif op == 'release' then
  take()
elseif op == 'removed' then
  local v, m = take()
  if not v then v, m = tonumber(ARGV[4]), tonumber(ARGV[5]) end
  if mode == 'optimistic' then
    redis.call('HINCRBY', node, 'rep_vcpus', -v)
    redis.call('HINCRBY', node, 'rep_mem', -m)
  else
    if redis.call('HEXISTS', rm_key, sandbox) == 0 then
      redis.call('HSET', rm_key, sandbox, v .. ',' .. m)
      if redis.call('SISMEMBER', listed_key, sandbox) == 1 then
        redis.call('HINCRBY', node, 'rm_vcpus', v)
        redis.call('HINCRBY', node, 'rm_mem', m)
      end
    end
  end
end
return 1
