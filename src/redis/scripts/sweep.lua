-- sweep: returns the items of expired reservations to the free index. Atomic and idempotent, so every
-- instance may run it without a lock. Reservations whose commit pin ran out (the instance confirming
-- them died or stalled), and expired ones that ever started a commit, are handed back to the caller,
-- which asks Postgres what happened.
-- ARGV: 1 base, 2 batch size (reservations), 3 retention ms, 4 recheck ms (when to look again at a stalled
--       commit), 5 work budget: the batch ends early once the items freed so far needed this many index
--       writes (one per item, attribute and group), so that one call stays short whatever the reservations hold,
--       6 grace ms (see reserve)
-- Returns: {reservations expired, items freed, 1 if more may be due now (else 0), stalled rid...}
local base, batch, retention, recheck = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local budget, grace = tonumber(ARGV[5]), tonumber(ARGV[6])
local now = now_ms()
local exp = base .. 'exp'
local due = redis.call('ZRANGEBYSCORE', exp, '-inf', now, 'LIMIT', 0, batch)
local expired, freed, work, reply = 0, 0, 0, { 0, 0, #due == batch and 1 or 0 }
local came_free, waited = {}, waited_in(base)

-- The index writes that freeing these items takes.
local function writes(items)
  local n = 0
  for _, item in ipairs(items) do
    n = n + 1
    if type(item.a) == 'table' then
      for _ in pairs(item.a) do n = n + 1 end
    end
    if has_group(item) then n = n + 1 end
  end
  return n
end

for _, rid in ipairs(due) do
  if work >= budget then
    reply[3] = 1
    break
  end
  local rkey = base .. 'r:' .. rid
  local r = read_reservation(rkey) or {}
  -- Held again after a commit epoch that Postgres is known to have ended ('ad'): a plain expiry, with no need of Postgres.
  if r.s == 'confirming' or (r.s == 'held' and r.ep and redis.call('HGET', rkey, 'ad') ~= r.ep) then
    -- Its commit's outcome is Postgres' to tell (the caller asks). Its items whose hold is no longer its own need
    -- not wait for that, which may be long with Postgres down: every pin holds the items it selects until the
    -- epoch is decided (finish or abort), so an item whose hold ran out was in no undecided commit. They are free.
    local items = decode_items_safely(r.i)
    work = work + writes(items)
    local n, fresh = free_items(base, rid, items, true, waited)
    freed = freed + n
    append_items(came_free, fresh)
    -- Looked at again a recheck later, or when its commit window ends, or when the holds of the items it did not
    -- select run out (as pin.lua sets it), whichever is soonest: those items are freed then (above), not a recheck
    -- later, should Postgres still not tell the commit's outcome (invariant 4).
    local window_end = tonumber(r.pw or 0) or 0
    local next_look = now + recheck
    if r.s == 'confirming' and window_end > now then next_look = math.min(next_look, window_end) end
    local holds_end = (tonumber(r.e) or 0) + grace + 1
    if holds_end > now then next_look = math.min(next_look, holds_end) end
    redis.call('ZADD', exp, next_look, rid)
    reply[#reply + 1] = rid
  elseif r.s == 'held' then
    -- Items that are not items (a hand edit of Redis, say) are not freed, so that expiry goes on in this pool:
    -- their holds run out and the rebuild re-adds them. Neither are any if the list is not a list; what the
    -- reservation counted against its owner then stays counted.
    local items, counted = decode_items_safely(r.i)
    if not counted or #items < #counted then
      redis.log(redis.LOG_WARNING, 'respool: reservation ' .. rid .. ' lists malformed items; expired without freeing them')
    end
    local fields = { 's', 'expired' }
    if counted then uncount_into(base, r, counted, fields) end
    work = work + writes(items)
    local n, fresh = free_items(base, rid, items, false, waited)
    freed = freed + n
    append_items(came_free, fresh)
    redis.call('HSET', rkey, unpack(fields))
    redis.call('PEXPIRE', rkey, retention)
    redis.call('ZREM', exp, rid)
    expired = expired + 1
  else
    redis.call('ZREM', exp, rid)
  end
end
reply[1], reply[2] = expired, freed
wake_waiters(base, came_free)
return reply
