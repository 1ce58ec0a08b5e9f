-- add_free: puts items that are free in Postgres into the free index: new imports, released allocations,
-- and the rebuild of a wiped or drifted Redis from Postgres.
-- An item under a live hold is cached but not indexed; an allocation tombstone is dropped only when the
-- item's version is newer than the allocation's (it was released since), so a page read before a commit
-- re-adds nothing.
-- Generation fence: tombstones do not survive a wipe, so a page read before a wipe may hold items allocated
-- since. Nothing is added to a pool without a generation key (wiped, not rebuilt yet: the rebuild writes the
-- key, then reads Postgres again) nor to one whose generation is newer than the caller's read. An older
-- key is raised to the caller's generation.
-- Age fence: an allocation's tombstone lasts tombstone ms from its finish, which came after any read that saw the
-- item free. A read older than that (its caller stalled between Postgres and Redis) could re-add an item allocated
-- since, whose tombstone is gone: nothing is added once the read is older than the caller's limit, which is below
-- the tombstone's life. Both times are Redis' own clock, so the hosts' clocks need not agree.
-- ARGV: 1 base, 2 Redis generation the caller read Postgres in, 3 Redis' time (ms) before that read, 4 the oldest
--       read accepted (ms), 5.. item JSON ({"id","v","n","g","a"})
-- Returns: number of items that were not in the free index before, or (nothing added) -1 if the read is too old,
--          -2 if the pool's generation is newer than the caller's
local base, generation, read_ms, max_age = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
if now_ms() - read_ms > max_age then return -1 end
local current = redis.call('GET', base .. 'gen')
if not current then return 0 end
-- A pool being created (its key pending, see set_generation): as if a rebuild came since; its creator's generation
-- is not known yet.
if not tonumber(current) then return -2 end
if tonumber(current) > generation then return -2 end
if tonumber(current) < generation then redis.call('SET', base .. 'gen', generation) end
-- The items nobody holds, indexed together at the end (one ZADD on the free index for all of them).
local free = {}
for i = 5, #ARGV do
  local json = ARGV[i]
  local item = cjson.decode(json)
  local hkey = base .. 'h:' .. item.id
  local holder = redis.call('GET', hkey)
  if tombstone_stale(holder, item.n) then
    redis.call('DEL', hkey)
    holder = false
  end
  -- Not allocated: cache the item (unless the cache is newer); index it only if nobody holds it. An item
  -- under a live hold needs its cache entry when the hold ends, to go back into the index then.
  if not is_tombstone(holder) then
    local cached = decode_item(item_get(base, item.id))
    if not cached or cached.n <= item.n then
      item_set(base, item.id, json)
      if not holder then free[#free + 1] = item end
    end
  end
end
local added, fresh = index_all(base, free, waited_in(base))
wake_waiters(base, fresh)
return added
