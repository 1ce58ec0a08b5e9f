-- unpin: a commit attempt failed before reaching Postgres' decision (Postgres unreachable, a timeout):
-- the reservation is held again until its own expiry, as if the confirm had never come, so the caller
-- can retry. Only while the failed pin is the reservation's last one ('pn', the pin number, is still its): not
-- when another confirm has joined its epoch since (that one is still committing), nor when a later pin opened
-- another epoch. The pin number is never reset, so an unpin sent twice (HoldStore retries a script that timed
-- out) cannot act on a pin that came after its first run, which may have given epoch 1 up (below), whatever
-- Redis' clock did. (A version before pin numbers does not number its pins: the README says not to run the two
-- side by side.)
-- When the attempt may have landed, the holds of the items it chose stay pinned: they end only when the sweeper
-- has asked Postgres (at expiry, the reservation having an epoch), and past its expiry the reservation is left to
-- the sweeper. When it cannot land (it surely never reached Postgres, or Postgres has ended its epoch: ARGV 6
-- and 7 are given), the confirm's 503 says nothing was changed, and Redis is put back as far as it can be:
-- - the items the failed pin took back after their hold had run out (pin's "retaken") go back to the pool: no
--   earlier epoch had them (a pin holds its items until its epoch is decided);
-- - if that pin opened the reservation's first epoch, every other hold it pinned was the reserve's own: each
--   gets back the end the reservation gives it, and the reservation has no epoch again (a confirm after this
--   opens epoch 1 once more; should Postgres have recorded that epoch as given up meanwhile, that confirm's
--   commit is refused, and it pins again in epoch 2). Its expiry is then a plain one: nothing waits for Postgres.
-- When Postgres has ended every epoch of the reservation up to this one (ARGV 8), no commit can land on its holds:
-- they end with the hold again, as after abort's "held again", so that at expiry the sweep frees the items without
-- waiting for Postgres (invariant 4), and the reservation records the epoch as ended ('ad', for extend).
-- A pin that got no answer (a Redis timeout, sent twice) may have run, or may still run, while its confirm is
-- answered 503 (nothing was changed): it is undone by its attempt's token (ARGV 9), sent after it on the same
-- connection. Only a pin that opened the epoch records its token ('eo'); that attempt never reached Postgres (it
-- had no answer to go on with), so it cannot land, and is undone as above with what its pin recorded (its epoch,
-- number and what it took back), unless another pin came after it (it joined the epoch, and is committing). A pin
-- that joined an epoch is left to the opener, whose own outcome settles it.
-- ARGV: 1 base, 2 rid, 3 epoch, 4 the failed pin's number, 5 grace ms (see reserve),
--       6 the ids the failed pin took back, comma separated, if the attempt cannot land ("" = none),
--       7 "1" if the attempt cannot land and its pin opened the epoch, 8 "1" if Postgres has ended every epoch up
--       to this one, 9 (instead of 3, 4, 6 and 7, which are then "") the token of an attempt whose pin got no answer
-- Returns: 1 if the reservation is held again, 0 if it was left for the sweeper to settle (or, with a token, the pin
--          has not run, joined an epoch, or another pin came after it)
local base, rid, epoch, pin_number, grace = ARGV[1], ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[5])
local retaken, restore, ended = ARGV[6], ARGV[7] == '1' and ARGV[3] == '1', ARGV[8] == '1'
local rkey = base .. 'r:' .. rid
if ARGV[9] and ARGV[9] ~= '' then
  local eo, op, rt, ep = unpack(redis.call('HMGET', rkey, 'eo', 'op', 'rt', 'ep'))
  if eo ~= ARGV[9] or not op then return 0 end
  epoch, pin_number, retaken, restore = ep, op, rt or '', ep == '1'
end
local f = redis.call('HMGET', rkey, 's', 'e', 'ep', 'pn', 'i', 'sel')
local now = now_ms()
if f[1] ~= 'confirming' or f[3] ~= epoch or tonumber(f[4]) ~= tonumber(pin_number) then return 0 end
local expires = tonumber(f[2])
if not restore and not ended then
  if expires > now then
    -- The sweep looks 1 ms after the holds of the items not chosen end (Redis drops a key only once its time is
    -- past), so that it finds them gone and frees those items.
    redis.call('HSET', rkey, 's', 'held')
    redis.call('ZADD', base .. 'exp', expires + grace + 1, rid)
    return 1
  end
  if retaken == '' then return 0 end
end
local back, wanted, chosen = {}, {}, {}
for id in string.gmatch(retaken, '[^,]+') do wanted[id] = true end
for id in string.gmatch(f[6] or '', '[^,]+') do chosen[id] = true end
for _, item in ipairs(decode_items(f[5])) do
  local hkey = base .. 'h:' .. item.id
  -- Once every epoch is ended, every hold still its own ends with the hold: an earlier epoch of another selection
  -- may have pinned items this one did not choose.
  if (chosen[item.id] or ended) and redis.call('GET', hkey) == rid then
    if wanted[item.id] then
      redis.call('DEL', hkey)
      -- (Unheld before the pin, it may have been allocated meanwhile: then it has no cache entry, and stays out.)
      if redis.call('HEXISTS', item_key(base, item.id), item.id) == 1 then back[#back + 1] = item end
    elseif restore or ended then
      -- Past its end already, Redis drops it now, and the sweep frees the item.
      redis.call('PEXPIREAT', hkey, expires + grace)
    end
  end
end
local _, fresh = index_all(base, back, waited_in(base))
wake_waiters(base, fresh)
if not restore then
  if not ended then return 0 end
  if expires <= now then
    -- Past its expiry: held, as far as its holds go, and left to the sweeper (due once they have ended), which
    -- expires it as a plain one without asking Postgres; a confirm that comes in the grace opens a new epoch.
    redis.call('HSET', rkey, 's', 'held', 'ad', epoch, 'pw', tostring(now))
    redis.call('ZADD', base .. 'exp', math.max(now, expires + grace + 1), rid)
    return 0
  end
  -- Held again; the sweep looks 1 ms after the holds end (Redis drops a key only once its time is past).
  redis.call('HSET', rkey, 's', 'held', 'ad', epoch)
  redis.call('ZADD', base .. 'exp', expires + grace + 1, rid)
  return 1
end
redis.call('HSET', rkey, 's', 'held')
redis.call('HDEL', rkey, 'ep', 'sel', 'pw', 'ad', 'eo', 'rt', 'op', 'px')
redis.call('ZADD', base .. 'exp', expires + grace, rid)
return 1
