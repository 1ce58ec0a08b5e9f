-- release: DELETE /v1/reservations/{id} and task abandon. Returns the reservation's held items to the
-- free index at once. Idempotent.
-- A reservation that once started a commit (it has an epoch) is released only once Postgres has
-- recorded that epoch as given up (ARGV 4 = the epoch so decided): its commit may have landed unseen.
-- ARGV: 1 base, 2 rid, 3 retention ms, 4 epoch decided 'abort' in Postgres ("" = none), 5 an Idempotency-Key
--       ("" = none): the undoing of a keyed reserve whose answer timed out, which forgets the key if it names
--       this reservation, and changes nothing once a retry with the key was answered with it (reserve's replay)
-- Returns: {"released", ...reservation} | {"confirmed", ...reservation} | {"busy"} (a confirm is committing)
--          | {"undecided", epoch} | {"missing"} | {"replayed"}
local base, rid, retention, decided, idem_key = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[5]
local rkey = base .. 'r:' .. rid
if idem_key ~= '' then
  if redis.call('HGET', rkey, 'rp') then return { 'replayed' } end
  local ikey = base .. 'idem:' .. idem_key
  local named = redis.call('GET', ikey)
  if named and string.sub(named, 1, #rid + 1) == rid .. '\n' then redis.call('DEL', ikey) end
end
local r = read_reservation(rkey)
local now = now_ms()
if not r then return { 'missing' } end
if r.s == 'confirmed' then return reply_of('confirmed', rid, r, now) end
if r.s == 'confirming' then return { 'busy' } end
if r.s == 'held' and r.ep and r.ep ~= decided then return { 'undecided', r.ep } end
if r.s ~= 'released' then
  if r.s == 'held' then
    local items = decode_items(r.i)
    free_items(base, rid, items)
    redis.call('HSET', rkey, unpack(uncount_into(base, r, items, { 's', 'released' })))
  else
    redis.call('HSET', rkey, 's', 'released')
  end
  r.s = 'released'
  redis.call('PEXPIRE', rkey, retention)
  redis.call('ZREM', base .. 'exp', rid)
end
return reply_of('released', rid, r, now)
