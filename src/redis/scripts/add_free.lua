-- add_free: puts items that are free in Postgres into the free index: new imports, released allocations,
-- and the rebuild of a wiped or drifted Redis from Postgres.
-- An item under a live hold is skipped; an allocation tombstone is dropped only when the item's version
-- is newer than the allocation's (it was released since), so a page read before a commit re-adds nothing.
-- An existing generation key is raised to the generation the caller read Postgres in; a missing one (Redis
-- wiped) is left for the rebuild to write.
-- ARGV: 1 base, 2 Redis generation, 3.. item JSON ({"id","v","n","g","a"})
-- Returns: number of items that were not in the free index before
local base, generation = ARGV[1], tonumber(ARGV[2])
local current = redis.call('GET', base .. 'gen')
if current and tonumber(current) < generation then redis.call('SET', base .. 'gen', generation) end
local added = 0
for i = 3, #ARGV do
  local json = ARGV[i]
  local item = cjson.decode(json)
  local hkey = base .. 'h:' .. item.id
  local holder = redis.call('GET', hkey)
  if tombstone_stale(holder, item.n) then
    redis.call('DEL', hkey)
    holder = false
  end
  if not holder then
    local cached = redis.call('HGET', base .. 'item', item.id)
    if not cached or cjson.decode(cached).n <= item.n then
      redis.call('HSET', base .. 'item', item.id, json)
      added = added + index(base, item)
    end
  end
end
return added
