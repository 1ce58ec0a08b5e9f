-- abort: settles a commit epoch that Postgres recorded as aborted (a version conflict, or a commit that
-- stalled past its window). While the hold has not expired, the reservation is held again, so its owner
-- may retry; after expiry it becomes expired and its items return to the free index, with what Postgres
-- says now: items allocated there get an allocation tombstone instead, items whose version moved on are
-- re-cached with the new version.
-- What Postgres said is fenced by its age, as in add_free: a read older than the caller's limit (it stalled after
-- it) may have missed an allocation whose tombstone is gone, and changes nothing.
-- ARGV: 1 base, 2 rid, 3 epoch, 4 retention ms, 5 tombstone ms, 6 items allocated in Postgres ("id:version", comma
--       separated), 7 grace ms (see reserve), 8 Redis' time (ms) before the Postgres read, 9 the oldest read
--       accepted (ms), 10.. fresh item JSON for items whose version changed
-- Returns: items returned to the free index, -1 if the epoch is no longer the reservation's open one,
--          -2 if the reservation is held again, -3 if the read is too old
local base, rid, epoch, retention, tombstone_ms = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5])
local grace = tonumber(ARGV[7])
local now = now_ms()
if now - tonumber(ARGV[8]) > tonumber(ARGV[9]) then return -3 end
local rkey = base .. 'r:' .. rid
local r = read_reservation(rkey) or {}
if (r.s ~= 'confirming' and r.s ~= 'held') or r.ep ~= epoch then return -1 end
local items = decode_items(r.i)

local allocated = {}
for entry in string.gmatch(ARGV[6], '[^,]+') do
  local sep = string.find(entry, ':', 1, true)
  allocated[string.sub(entry, 1, sep - 1)] = string.sub(entry, sep + 1)
end
local fresh = {}
for i = 10, #ARGV do
  local item = cjson.decode(ARGV[i])
  fresh[item.id] = { item = item, json = ARGV[i] }
end

local back, came_free, waited = {}, {}, waited_in(base)
for _, item in ipairs(items) do
  local hkey = base .. 'h:' .. item.id
  local holder = redis.call('GET', hkey)
  if allocated[item.id] then
    local cached = decode_item(item_get(base, item.id))
    if cached and cached.n > tonumber(allocated[item.id]) then
      -- The cache is newer than the allocation Postgres showed: released since, free at that version.
      local _, came = free_items(base, rid, { cached }, false, waited)
      append_items(came_free, came)
    else
      if holder == rid or not holder then redis.call('SET', hkey, tombstone(allocated[item.id]), 'PX', tombstone_ms) end
      item_del(base, item.id)
      unindex(base, item)
    end
  elseif fresh[item.id] then
    -- As add_free: never over a newer cache entry (released again since Postgres was read: free at that
    -- version), nor for an item allocated since the read (its tombstone is newer than the version read).
    local f = fresh[item.id]
    local cached = decode_item(item_get(base, item.id))
    if cached and cached.n > f.item.n then
      back[#back + 1] = cached
    elseif not is_tombstone(holder) or tombstone_stale(holder, f.item.n) then
      if is_tombstone(holder) then redis.call('DEL', hkey) end
      item_set(base, item.id, f.json)
      back[#back + 1] = f.item
    end
  else
    back[#back + 1] = item
  end
end

local expires = tonumber(r.e)
if expires > now and next(allocated) == nil and next(fresh) == nil then
  -- Nothing changed under it and the hold is still due: held again, owner may retry the confirm. Postgres has
  -- ended every epoch of it up to this one, so no commit can land on these holds: they end with the hold, as the
  -- reserve's did, and the sweep frees them then without waiting for Postgres (invariant 4). A confirm that comes
  -- first pins what it selects again, in a new epoch.
  for _, item in ipairs(items) do
    local hkey = base .. 'h:' .. item.id
    local holder = redis.call('GET', hkey)
    if holder == rid or not holder then
      unindex(base, item)
      redis.call('SET', hkey, rid, 'PX', expires + grace - now)
    end
  end
  -- 'ep' stays: at expiry the sweeper asks Postgres again, which already says 'abort' for this epoch. It looks 1 ms
  -- after the holds end (Redis drops a key only once its time is past), so it finds them gone and frees the items.
  redis.call('HSET', rkey, 's', 'held', 'ad', epoch)
  redis.call('ZADD', base .. 'exp', expires + grace + 1, rid)
  return -2
end

local freed, came = free_items(base, rid, back, false, waited)
append_items(came_free, came)
redis.call('HSET', rkey, unpack(uncount_into(base, r, items, { 's', 'expired' })))
redis.call('PEXPIRE', rkey, retention)
redis.call('ZREM', base .. 'exp', rid)
wake_waiters(base, came_free)
return freed
