-- pin: first step of confirm/complete. Checks that every selected item is still this reservation's
-- (re-taking, after expiry, an item nobody else took) and pins those holds until the commit is decided;
-- the sweeper looks at the reservation again when the commit window ends.
-- A pin starts a new commit epoch unless it is the same confirm again (same selection) while the
-- epoch's window is open: then it joins (whichever commits first, the other finds the commit).
-- Postgres records who ended each epoch (the commit, or an abort), so the two can never both happen.
-- A confirm must not join an epoch that may already be given up: after the window (the sweeper gives
-- it up), or with another selection (the first one's version conflict gives it up), nor one its caller
-- knows Postgres ended (ARGV 6), nor, after that, one another attempt opened since (a retry, whose failure
-- would end it); its own commit would be refused while its hold is still due. Two epochs cannot both commit:
-- Postgres keeps one commit per reservation.
-- ARGV: 1 base, 2 rid, 3 commit window ms, 4 selection (resource ids, comma separated, sorted), 5 grace ms (see
--       reserve), 6 an epoch Postgres has ended ("" = none known): the pin then joins no epoch, even while its window
--       is open, but one its own first run opened (a re-send),
--       7 how long an open record lasts at least (see reserve): a pin re-opens an expired one, 8 the attempt's token
--       (the same in both sends of a pin HoldStore sends again after a Redis timeout), 9 the kind the caller acts on
--       ("r" a reservation, "l" a lease; "" or none: either): a record of the other kind is "missing" to it
-- Returns: {"pinned", rid, state, owner, kind, createdMs, expiresMs, itemsJson, outcomeJson, nowMs, epoch, generation,
--          pinnedUntil, retaken: the ids of the selected items whose hold had run out, which this pin took back
--          (comma separated), opened: "1" if this pin started the epoch (else it joined one), this pin's number;
--          for the second send of a pin whose first run opened the epoch, retaken, opened and the number are the first
--          run's (the second takes no number of its own), the reservation's "<Idempotency-Key>\n<body hash>" ("" = none)}
--          | {"confirmed", ...the same fields up to pinnedUntil} (already committed) | {"missing"} | {"closed"} | {"notin", id}
--          | {"lost", id}
local base, rid, window, selection, grace, ended = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4], tonumber(ARGV[5]), ARGV[6]
local open_record, token, kind = tonumber(ARGV[7]), ARGV[8], ARGV[9] or ''
local rkey = base .. 'r:' .. rid
local r = read_reservation(rkey)
local now = now_ms()
if not r or (kind ~= '' and r.k ~= kind) then return { 'missing' } end
if r.s == 'confirmed' then return reply_of('confirmed', rid, r, now) end
if r.s == 'released' then return { 'closed' } end

local items = decode_items(r.i)
local by_id = {}
for _, item in ipairs(items) do by_id[item.id] = item end
local selected = {}
for id in string.gmatch(selection, '[^,]+') do
  if not by_id[id] then return { 'notin', id } end
  selected[#selected + 1] = by_id[id]
end

-- Check everything before changing anything.
local holders = {}
for i, item in ipairs(selected) do
  holders[i] = redis.call('GET', base .. 'h:' .. item.id)
  if holders[i] and holders[i] ~= rid then return { 'lost', item.id } end
end

-- A selected item no longer held shows that the epoch's attempts so far cannot land (a pin holds its items until its
-- epoch is decided, or until its un-pin found it could not land and gave them back; in one Redis history: a failover
-- that loses writes is DESIGN.md's accepted loss): a pin that must take one back opens a new epoch, which none of
-- them can end from under it.
local retaken = {}
for i, item in ipairs(selected) do
  if holders[i] ~= rid then retaken[#retaken + 1] = item.id end
end
-- A pin that knows an ended epoch (the one more try of a commit refused as decided) joins no epoch but its own first
-- run's (a re-send): an epoch opened since by another attempt may be ended by that attempt's failure at any time.
local opened = r.s ~= 'confirming' or tonumber(r.pw or 0) <= now or r.sel ~= selection or (ended ~= '' and redis.call('HGET', rkey, 'eo') ~= token)
  or #retaken > 0
-- Every pin of the reservation gets the next number ('pn', never reset), so that unpin can tell whether another
-- pin came after the one whose commit failed, whatever Redis' clock did.
-- The epoch's opener is known by its attempt's token ('eo'), what it took back by 'rt' and its number by 'op': a pin
-- sent again after a timeout, whose first run opened the epoch, answers as that run did (it joins its own epoch and
-- takes nothing back), with that run's number, taking none of its own: unpin then acts for it only if no other pin
-- came after its first run, as for a pin sent once.
local reported_opened, reported_retaken = opened, table.concat(retaken, ',')
local pin_number, resent = nil, false
if opened then
  r.ep = tostring(tonumber(r.ep or 0) + 1)
else
  local eo, rt, op = unpack(redis.call('HMGET', rkey, 'eo', 'rt', 'op'))
  if eo == token and op then reported_opened, reported_retaken, pin_number, resent = true, rt or '', op, true end
end
pin_number = pin_number or tostring((tonumber(r.pn) or 0) + 1)
-- A pin of a confirming reservation never moves the window's end back (should the clock have gone back).
local window_end = now + window
if r.s == 'confirming' and tonumber(r.pw or 0) >= window_end then window_end = tonumber(r.pw) + 1 end
local earlier_selection = r.sel
r.s, r.sel, r.pw = 'confirming', selection, tostring(window_end)
if opened then
  redis.call('HSET', rkey, 's', r.s, 'sel', r.sel, 'pw', r.pw, 'ep', r.ep, 'pn', pin_number, 'eo', token, 'rt', reported_retaken,
    'op', pin_number)
  -- 'px': every item a commit epoch not ended yet may allocate (the union of their selections), whose holds extend must
  -- not shorten; the rest of the reservation's holds are plain ones. Not written while that is the selection ('sel') of
  -- epoch 1, or of an epoch all those before which are ended ('ad'): extend then reads 'sel'. '*' (not known: epochs
  -- opened by a version before 'px') keeps every hold from shortening.
  local before = tonumber(r.ep) - 1
  if before > 0 and tonumber(redis.call('HGET', rkey, 'ad')) ~= before then
    local old = redis.call('HGET', rkey, 'px') or (before == 1 and earlier_selection) or '*'
    local px = '*'
    if old ~= '*' then
      local seen, ids = {}, {}
      for id in string.gmatch(old .. ',' .. selection, '[^,]+') do
        if not seen[id] then seen[id], ids[#ids + 1] = true, id end
      end
      px = table.concat(ids, ',')
    end
    redis.call('HSET', rkey, 'px', px)
  elseif before > 0 then
    redis.call('HDEL', rkey, 'px')
  end
elseif resent then
  redis.call('HSET', rkey, 's', r.s, 'sel', r.sel, 'pw', r.pw)
else
  redis.call('HSET', rkey, 's', r.s, 'sel', r.sel, 'pw', r.pw, 'ep', r.ep or '0', 'pn', pin_number)
end
-- The sweeper looks at it when the window ends, or when the holds of the items not selected run out, if that is
-- sooner: should this confirm never end (its instance died), those items are free again then (invariant 4), not
-- a window later. (The sweep leaves the items this reservation still holds alone.)
redis.call('ZADD', base .. 'exp', math.min(window_end, (tonumber(r.e) or now) + grace + 1), rid)
-- The record (and the pinned holds, below) last until the sweeper has settled the epoch. An expired record that
-- this pin re-opens had only its retention left, which may be short (RESERVATION_RETENTION_MS): gone before the
-- epoch was settled, its chosen items would stay out of the pool until a rebuild.
local keep = window + math.max(tonumber(redis.call('PTTL', rkey)), open_record)
redis.call('PEXPIRE', rkey, keep)
-- From now on Postgres may commit these items at any moment, until the epoch is decided. Their holds
-- therefore last as long as the reservation record: they end when the decision is applied (finish, or
-- abort), never on their own; an item unheld while its commit is undecided could be put back in the
-- free index by a rebuild page read before the commit.
for i, item in ipairs(selected) do
  local hkey = base .. 'h:' .. item.id
  if holders[i] ~= rid then
    -- The hold expired. Nobody else holds the item: take it back (out of the free index if the
    -- sweeper already returned it); the version check in Postgres decides whether it is still ours.
    unindex(base, item)
  end
  redis.call('SET', hkey, rid, 'PX', keep)
end
local reply = reply_of('pinned', rid, r, now)
reply[#reply + 1] = reported_retaken
reply[#reply + 1] = reported_opened and '1' or '0'
reply[#reply + 1] = pin_number
reply[#reply + 1] = redis.call('HGET', rkey, 'ik') or ''
return reply
