-- unpin: a commit attempt failed before reaching Postgres' decision (Postgres unreachable, a timeout):
-- the reservation is held again until its own expiry, as if the confirm had never come, so the caller
-- can retry. Only while the hold has not expired and only for the epoch that failed. The holds stay
-- pinned: the commit may have landed unseen, so they end only when the sweeper has asked Postgres
-- (at expiry, the reservation having an epoch). Not when another confirm has joined the epoch since
-- (the window end, 'pw', is no longer the failed pin's: every pin moves it): that one is still committing.
-- Past its expiry the reservation is left for the sweeper to settle, but when the commit surely never reached
-- Postgres (ARGV 6 lists items), the items the failed pin took back after their hold had run out (pin's
-- "retaken") go back to the pool at once: the epoch cannot land without a pin that joined it, and no earlier
-- epoch had them (a pin holds its items until its epoch is decided), so the 503 leaves them as it found them.
-- ARGV: 1 base, 2 rid, 3 epoch, 4 the window end the failed pin set, 5 grace ms (see reserve),
--       6 the ids the failed pin took back, comma separated, if its commit surely never reached Postgres ("" = none)
-- Returns: 1 if the reservation is held again, 0 if it was left for the sweeper to settle
local base, rid, epoch, window_end, grace, retaken = ARGV[1], ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[5]), ARGV[6]
local rkey = base .. 'r:' .. rid
local f = redis.call('HMGET', rkey, 's', 'e', 'ep', 'pw', 'i')
local now = now_ms()
if f[1] ~= 'confirming' or f[3] ~= epoch or tonumber(f[4]) ~= tonumber(window_end) then return 0 end
local expires = tonumber(f[2])
if expires <= now then
  if retaken ~= '' then
    local back, wanted = {}, {}
    for id in string.gmatch(retaken, '[^,]+') do wanted[id] = true end
    for _, item in ipairs(decode_items(f[5])) do
      local hkey = base .. 'h:' .. item.id
      if wanted[item.id] and redis.call('GET', hkey) == rid then
        redis.call('DEL', hkey)
        -- (Unheld before the pin, it may have been allocated meanwhile: then it has no cache entry, and stays out.)
        if redis.call('HEXISTS', item_key(base, item.id), item.id) == 1 then back[#back + 1] = item end
      end
    end
    index_all(base, back)
  end
  return 0
end
redis.call('HSET', rkey, 's', 'held')
redis.call('ZADD', base .. 'exp', expires + grace, rid)
return 1
