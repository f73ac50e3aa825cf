-- A reservation's life after Place, atomically: the Redis twin of NodeView::created,
-- ::release and ::removed.
--
-- KEYS: node hash, reservations hash, removals hash, listed set.
-- ARGV: op (created | release | removed), sandbox_id, mode, vcpus, memory_bytes (what the
--       sandbox held, for removed without a reservation)
-- Returns: 1, or 0 when the node is unknown.
--
-- Every number written goes through `int` (Lua's own conversion writes 1e14 and more in
-- exponent notation, and -0 for a negated zero, which HINCRBY rejects); resources are exact up
-- to 2^53. What is stored is read and parsed before the first write, so a malformed value fails
-- the script without leaving half of it done.
local node, res_key, rm_key, listed_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local op, sandbox, mode = ARGV[1], ARGV[2], ARGV[3]
if redis.call('EXISTS', node) == 0 then return 0 end
if mode == 'stale' then return 1 end

-- An integral number as plain decimal digits ('0', never '-0').
local function int(x)
  if x == 0 then return '0' end
  return string.format('%.0f', x)
end

-- The sandbox's reservation, parsed: vcpus, memory, phase ('p' or 'u'); nil if it has none.
local reservation = redis.call('HGET', res_key, sandbox)
local res_v, res_m, res_phase
if reservation then
  res_v, res_m, res_phase = string.match(reservation, '^(%d+),(%d+),([pu]),%d+$')
  if not res_v then
    return redis.error_reply('ERR malformed reservation ' .. sandbox .. ' in ' .. res_key .. ': ' .. reservation)
  end
  res_v, res_m = tonumber(res_v), tonumber(res_m)
end

-- Drops the reservation, if any, and returns what it held.
local function take()
  if not reservation then return nil end
  redis.call('HDEL', res_key, sandbox)
  redis.call('HINCRBY', node, 'res_vcpus', int(-res_v))
  redis.call('HINCRBY', node, 'res_mem', int(-res_m))
  if res_phase == 'p' then
    redis.call('HINCRBY', node, 'pending', -1)
  else
    redis.call('HINCRBY', node, 'unconfirmed', -1)
  end
  return res_v, res_m
end

if op == 'created' then
  if mode == 'optimistic' then
    local v, m = take()
    if v then
      redis.call('HINCRBY', node, 'rep_vcpus', int(v))
      redis.call('HINCRBY', node, 'rep_mem', int(m))
    end
  elseif res_phase == 'p' then
    redis.call('HSET', res_key, sandbox, int(res_v) .. ',' .. int(res_m) .. ',u,0')
    redis.call('HINCRBY', node, 'pending', -1)
    redis.call('HINCRBY', node, 'unconfirmed', 1)
  end
elseif op == 'release' then
  take()
elseif op == 'removed' then
  if mode == 'optimistic' then
    local v, m = take()
    if not v then v, m = tonumber(ARGV[4]), tonumber(ARGV[5]) end
    redis.call('HINCRBY', node, 'rep_vcpus', int(-v))
    redis.call('HINCRBY', node, 'rep_mem', int(-m))
  else
    -- The marker holds what the sandbox held; a later removal of the same sandbox replaces it,
    -- as NodeView::removed does. Parsed before anything is written.
    local old_v, old_m = 0, 0
    local marker = redis.call('HGET', rm_key, sandbox)
    if marker then
      old_v, old_m = string.match(marker, '^(%d+),(%d+)$')
      if not old_v then
        return redis.error_reply('ERR malformed removal ' .. sandbox .. ' in ' .. rm_key .. ': ' .. marker)
      end
      old_v, old_m = tonumber(old_v), tonumber(old_m)
    end
    local v, m = take()
    if not v then v, m = tonumber(ARGV[4]), tonumber(ARGV[5]) end
    redis.call('HSET', rm_key, sandbox, int(v) .. ',' .. int(m))
    -- The running totals count the markers of listed sandboxes: the old one (if any) out, the
    -- new one in.
    if redis.call('SISMEMBER', listed_key, sandbox) == 1 then
      if v ~= old_v then redis.call('HINCRBY', node, 'rm_vcpus', int(v - old_v)) end
      if m ~= old_m then redis.call('HINCRBY', node, 'rm_mem', int(m - old_m)) end
    end
  end
end
return 1
