-- release: DELETE /v1/reservations/{id} and task abandon. Returns the reservation's held items to the
-- free index at once. Idempotent.
-- A reservation that once started a commit (it has an epoch) is released only once Postgres has
-- recorded that epoch as given up (ARGV 4 = the epoch so decided): its commit may have landed unseen.
-- ARGV: 1 base, 2 rid, 3 retention ms, 4 epoch decided 'abort' in Postgres ("" = none), 5 "1": the undoing of a
--       reserve request that got no answer, whose id is rid ("" = a release), 6 that request's Idempotency-Key
--       ("" = none), 7 the kind a release acts on ("r" a reservation, "l" a lease; "" or none: either): a record of the
--       other kind is "missing" to it
-- An undo: the request's own record, if its reserve has not run (yet), becomes a released one, which reserve
-- refuses: a reserve that arrives after its undo holds nothing. The reservation it made or was answered with (the
-- one its key names; without a key, its own) is released, and the key forgotten, once no request that may have
-- been answered with it is left: its `rq` field lists them (absent: only the request that made it), a replay adds
-- itself, an undo takes its request out. A request that was answered is never undone, so the reservation stays.
-- "*" (too many replays to list, see reserve.lua) is never emptied: the reservation stays until it expires.
-- Returns: {"released", ...reservation} | {"confirmed", ...reservation} | {"busy"} (a confirm is committing)
--          | {"undecided", epoch} | {"missing"} | {"answered"} (an undo: another request may have the reservation)
local base, rid, retention, decided = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
local undo, idem_key, kind = ARGV[5] == '1', ARGV[6], ARGV[7] or ''
local rkey = base .. 'r:' .. rid
if undo then
  if redis.call('EXISTS', rkey) == 0 then
    redis.call('HSET', rkey, 's', 'released')
    redis.call('PEXPIRE', rkey, retention)
  end
  local ikey, target = nil, rid
  if idem_key ~= '' then
    ikey = base .. 'idem:' .. idem_key
    local named = redis.call('GET', ikey)
    if not named then return { 'missing' } end
    target = string.sub(named, 1, string.find(named, '\n', 1, true) - 1)
  end
  local tkey = base .. 'r:' .. target
  -- A key naming a reservation Redis has no record of (put back by a rebuild after a wipe, from its commit): the
  -- request was answered from Postgres, or made nothing; there is nothing to release, nor a record to write into.
  if target ~= rid and redis.call('EXISTS', tkey) == 0 then return { 'missing' } end
  local left = {}
  for requester in string.gmatch(redis.call('HGET', tkey, 'rq') or target, '%S+') do
    if requester ~= rid then left[#left + 1] = requester end
  end
  if #left > 0 then
    redis.call('HSET', tkey, 'rq', table.concat(left, ' '))
    return { 'answered' }
  end
  redis.call('HSET', tkey, 'rq', '')
  if ikey then redis.call('DEL', ikey) end
  rid, rkey = target, tkey
end
local r = read_reservation(rkey)
local now = now_ms()
if not r or (kind ~= '' and r.k ~= kind) then return { 'missing' } end
if r.s == 'confirmed' then return reply_of('confirmed', rid, r, now) end
if r.s == 'confirming' then return { 'busy' } end
-- Held again after a commit epoch: Postgres must end it first (the caller settles it and sends `decided`), unless
-- Postgres is known to have ended it already ('ad', see abort and unpin).
if r.s == 'held' and r.ep and r.ep ~= decided and redis.call('HGET', rkey, 'ad') ~= r.ep then return { 'undecided', r.ep } end
if r.s ~= 'released' then
  local came_free = nil
  if r.s == 'held' then
    local items = decode_items(r.i)
    local _, fresh = free_items(base, rid, items, false, waited_in(base))
    redis.call('HSET', rkey, unpack(uncount_into(base, r, items, { 's', 'released' })))
    came_free = fresh
  else
    redis.call('HSET', rkey, 's', 'released')
  end
  r.s = 'released'
  redis.call('PEXPIRE', rkey, retention)
  redis.call('ZREM', base .. 'exp', rid)
  wake_waiters(base, came_free)
end
return reply_of('released', rid, r, now)
