-- unpin: a commit attempt failed before reaching Postgres' decision (Postgres unreachable, a timeout):
-- the reservation is held again until its own expiry, as if the confirm had never come, so the caller
-- can retry. Only while the hold has not expired and only for the epoch that failed. The holds stay
-- pinned: the commit may have landed unseen, so they end only when the sweeper has asked Postgres
-- (at expiry, the reservation having an epoch). Not when another confirm has joined the epoch since
-- (the window end, 'pw', is no longer the failed pin's): that one is still committing.
-- ARGV: 1 base, 2 rid, 3 epoch, 4 the window end the failed pin set, 5 grace ms (see reserve)
-- Returns: 1 if the reservation is held again, 0 if it was left for the sweeper to settle
local base, rid, epoch, window_end, grace = ARGV[1], ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[5])
local rkey = base .. 'r:' .. rid
local f = redis.call('HMGET', rkey, 's', 'e', 'ep', 'pw')
local now = now_ms()
if f[1] ~= 'confirming' or f[3] ~= epoch or tonumber(f[4]) ~= tonumber(window_end) then return 0 end
local expires = tonumber(f[2])
if expires <= now then return 0 end
redis.call('HSET', rkey, 's', 'held')
redis.call('ZADD', base .. 'exp', expires + grace, rid)
return 1
