-- release: DELETE /v1/reservations/{id} and task abandon. Returns the reservation's held items to the
-- free index at once. Idempotent.
-- A reservation that once started a commit (it has an epoch) is released only once Postgres has
-- recorded that epoch as given up (ARGV 4 = the epoch so decided): its commit may have landed unseen.
-- ARGV: 1 base, 2 rid, 3 retention ms, 4 epoch decided 'abort' in Postgres ("" = none), 5 "1": the undoing of a
--       reserve that got no answer ("" = a release), 6 that reserve's Idempotency-Key ("" = none)
-- An undo changes nothing once a retry with the key was answered with the reservation (reserve's replay), forgets
-- the key if it names this reservation, and, when the reserve has not run (yet), leaves a released record under its
-- id, which reserve refuses: a reserve that arrives after its undo holds nothing.
-- Returns: {"released", ...reservation} | {"confirmed", ...reservation} | {"busy"} (a confirm is committing)
--          | {"undecided", epoch} | {"missing"} | {"replayed"}
local base, rid, retention, decided = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
local undo, idem_key = ARGV[5] == '1', ARGV[6]
local rkey = base .. 'r:' .. rid
if undo then
  if redis.call('HGET', rkey, 'rp') then return { 'replayed' } end
  if idem_key ~= '' then
    local ikey = base .. 'idem:' .. idem_key
    local named = redis.call('GET', ikey)
    if named and string.sub(named, 1, #rid + 1) == rid .. '\n' then redis.call('DEL', ikey) end
  end
  if redis.call('EXISTS', rkey) == 0 then
    redis.call('HSET', rkey, 's', 'released')
    redis.call('PEXPIRE', rkey, retention)
    return { 'missing' }
  end
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
