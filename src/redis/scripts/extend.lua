-- extend: extend a live reservation or heartbeat a lease: expiresAt = now + ttl.
-- ARGV: 1 base, 2 rid, 3 ttl ms (already capped by the pool's maxHoldTtlMs), 4 how long the record outlives its
--       hold, ms (see reserve), 5 grace ms (see reserve), 6 the kind the caller acts on ("r" a reservation, "l" a
--       lease; "" or none: either): a record of the other kind is "missing" to it
-- Returns: {"extended", ...reservation} | {"expired"} | {"confirming"} (a confirm of it is committing) | {"closed"} |
--          {"missing"}
local base, rid, ttl, open_record_ms, grace = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local kind = ARGV[6] or ''
local rkey = base .. 'r:' .. rid
local r = read_reservation(rkey)
local now = now_ms()
if not r or (kind ~= '' and r.k ~= kind) then return { 'missing' } end
if r.s == 'expired' or (r.s == 'held' and tonumber(r.e) <= now) then return { 'expired' } end
if r.s == 'confirming' then return { 'confirming' } end
if r.s ~= 'held' then return { 'closed' } end
-- Holds of a reservation that started a commit last until the sweeper settles it: never shortened. Unless Postgres
-- has ended its last epoch ('ad', see abort and unpin): no commit can land on them, and they are plain holds again.
-- Only the items a commit epoch not ended yet may allocate ('px', see pin) are pinned: the others' holds are plain,
-- and end with the hold, shortened or not, so that at expiry the sweep frees them (invariant 4), Postgres down or not.
-- With no 'px', only the last epoch can be undecided (pin writes it otherwise; so did no version before it, whose
-- records are taken as it when the epochs before the last are ended): its selection ('sel') is pinned.
local ad = redis.call('HGET', rkey, 'ad')
local pinned = r.ep ~= false and ad ~= r.ep
local kept
if pinned then
  local px = redis.call('HGET', rkey, 'px')
  if not px and (r.ep == '1' or tonumber(ad) == tonumber(r.ep) - 1) then px = r.sel end
  if px and px ~= '*' then
    kept = {}
    for id in string.gmatch(px, '[^,]+') do kept[id] = true end
  end
end
for _, item in ipairs(decode_items(r.i)) do
  local hkey = base .. 'h:' .. item.id
  if redis.call('GET', hkey) ~= rid then return { 'expired' } end
  if not pinned or (kept and not kept[item.id]) or tonumber(redis.call('PTTL', hkey)) < ttl + grace then
    redis.call('PEXPIRE', hkey, ttl + grace)
  end
end
r.e = tostring(now + ttl)
redis.call('HSET', rkey, 'e', r.e)
-- With an epoch, the sweep leaves the holds still its own to Postgres: it looks 1 ms after they end (Redis drops a
-- key only once its time is past).
redis.call('ZADD', base .. 'exp', now + ttl + grace + (r.ep and 1 or 0), rid)
redis.call('PEXPIRE', rkey, ttl + grace + open_record_ms)
return reply_of('extended', rid, r, now)
