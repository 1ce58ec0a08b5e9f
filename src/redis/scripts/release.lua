-- release: DELETE /v1/reservations/{id} and task abandon. Returns the reservation's held items to the
-- free index at once. Idempotent.
-- A reservation that once started a commit (it has an epoch) is released only once Postgres has
-- recorded that epoch as given up (ARGV 4 = the epoch so decided): its commit may have landed unseen.
-- ARGV: 1 base, 2 rid, 3 retention ms, 4 epoch decided 'abort' in Postgres ("" = none)
-- Returns: {"released", ...reservation} | {"confirmed", ...reservation} | {"busy"} (a confirm is committing)
--          | {"undecided", epoch} | {"missing"}
local base, rid, retention, decided = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
local rkey = base .. 'r:' .. rid
local f = redis.call('HMGET', rkey, 's', 'ep')
local state, epoch = f[1], f[2]
local now = now_ms()
if not state then return { 'missing' } end
if state == 'confirmed' then return reservation_reply('confirmed', rid, rkey, now) end
if state == 'confirming' then return { 'busy' } end
if state == 'held' and epoch and epoch ~= decided then return { 'undecided', epoch } end
if state ~= 'released' then
  local items = decode_items(redis.call('HGET', rkey, 'i'))
  if state == 'held' then
    uncount(base, rkey, redis.call('HGET', rkey, 'o'), redis.call('HGET', rkey, 'k'), items)
    free_items(base, rid, items)
  end
  redis.call('HSET', rkey, 's', 'released')
  redis.call('PEXPIRE', rkey, retention)
  redis.call('ZREM', base .. 'exp', rid)
end
return reservation_reply('released', rid, rkey, now)
