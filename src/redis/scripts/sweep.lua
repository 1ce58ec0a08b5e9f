-- sweep: returns the items of expired reservations to the free index. Atomic and idempotent, so every
-- instance may run it without a lock. Reservations whose commit pin ran out (the instance confirming
-- them died or stalled), and expired ones that ever started a commit, are handed back to the caller,
-- which asks Postgres what happened.
-- ARGV: 1 base, 2 batch size, 3 retention ms, 4 recheck ms (when to look again at a stalled commit)
-- Returns: {reservations expired, items freed, stalled rid...}
local base, batch, retention, recheck = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local now = now_ms()
local exp = base .. 'exp'
local due = redis.call('ZRANGEBYSCORE', exp, '-inf', now, 'LIMIT', 0, batch)
local expired, freed, reply = 0, 0, { 0, 0 }
for _, rid in ipairs(due) do
  local rkey = base .. 'r:' .. rid
  local r = read_reservation(rkey) or {}
  if r.s == 'confirming' or (r.s == 'held' and r.ep) then
    redis.call('ZADD', exp, now + recheck, rid)
    reply[#reply + 1] = rid
  elseif r.s == 'held' then
    local items = decode_items(r.i)
    freed = freed + free_items(base, rid, items)
    redis.call('HSET', rkey, unpack(uncount_into(base, r, items, { 's', 'expired' })))
    redis.call('PEXPIRE', rkey, retention)
    redis.call('ZREM', exp, rid)
    expired = expired + 1
  else
    redis.call('ZREM', exp, rid)
  end
end
reply[1], reply[2] = expired, freed
return reply
