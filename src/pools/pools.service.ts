import { Injectable, Logger } from '@nestjs/common';
import { DomainError, ErrorCode } from '../common/errors.js';
import { PoolEntity, RESOURCE_ALLOCATED, RESOURCE_FREE } from '../database/entities.js';
import { GenerationRepository } from '../database/generation.repository.js';
import { PoolRepository } from '../database/pool.repository.js';
import { NewResource, ResourceRepository, ResourceRow } from '../database/resource.repository.js';
import { isAllocationTombstone } from '../redis/keys.js';
import { isStringRecord } from '../common/validators.js';
import { CachedItem, HoldStore, PENDING_GENERATION_MS, toCachedItem } from '../redis/hold-store.repository.js';
import { CommitService } from '../reservations/commit.service.js';
import { PoolCatalog } from './pool-catalog.service.js';
import { Later } from '../common/later.js';
import { CreatePoolDto, ImportResourcesDto, ImportResultDto, PoolDto, PoolWithStatsDto, ResourceDto } from './pool.dto.js';

export const DEFAULT_HOLD_TTL_MS = 600_000;
/** Free items an instance keeps to index later (see reindexPending); beyond it, the periodic rebuild adds them. */
const MAX_UNINDEXED = 100_000;
/** Pools whose generation key an instance keeps to finalize later (see finalizeLater); beyond it, a rebuild does. */
const MAX_UNFINALIZED = 1000;
/** Pools whose generation key the upkeep looks at in one pass, at most (see finalizeLater). */
const SETTLE_BATCH = 200;
/** Items of a pool reindexPending reads and indexes in one go. */
const REINDEX_BATCH = 5000;
export const DEFAULT_MAX_HOLD_TTL_MS = 3_600_000;

export function toPoolDto(pool: PoolEntity): PoolDto {
  return {
    name: pool.name,
    kind: pool.kind,
    holdTtlMs: pool.holdTtlMs,
    maxHoldTtlMs: pool.maxHoldTtlMs,
    maxHoldsPerOwner: pool.maxHoldsPerOwner,
    createdAt: pool.createdAt.toISOString(),
  };
}

@Injectable()
export class PoolsService {
  private readonly logger = new Logger(PoolsService.name);
  /**
   * Items this instance made free in Postgres, or may have (a write whose answer was lost), that Redis may
   * not have indexed: by pool name, ids (`id:<id>`) or, for an import that got no answer, values
   * (`value:<value>`). See reindexPending.
   */
  private readonly unindexed = new Map<string, Set<string>>();

  constructor(
    private readonly pools: PoolRepository,
    private readonly resources: ResourceRepository,
    private readonly catalog: PoolCatalog,
    private readonly holds: HoldStore,
    private readonly generations: GenerationRepository,
    private readonly committer: CommitService,
  ) {}

  async create(dto: CreatePoolDto): Promise<PoolDto> {
    const holdTtlMs = dto.holdTtlMs ?? DEFAULT_HOLD_TTL_MS;
    // API.md's default, whatever holdTtlMs is: a longer holdTtlMs needs maxHoldTtlMs sent with it.
    const maxHoldTtlMs = dto.maxHoldTtlMs ?? DEFAULT_MAX_HOLD_TTL_MS;
    if (holdTtlMs > maxHoldTtlMs) {
      // The field the client sent is the one named; holdTtlMs if it sent both, or neither was its choice.
      throw DomainError.validation([
        dto.holdTtlMs === undefined
          ? {
              field: 'maxHoldTtlMs',
              reason: `maxHoldTtlMs must not be less than holdTtlMs (${holdTtlMs}, its default; send a holdTtlMs of at most ${maxHoldTtlMs})`,
            }
          : {
              field: 'holdTtlMs',
              reason: `holdTtlMs must not be greater than maxHoldTtlMs (${maxHoldTtlMs}${
                dto.maxHoldTtlMs === undefined ? `, its default; send a maxHoldTtlMs of at least ${holdTtlMs}` : ''
              })`,
            },
      ]);
    }
    // The pool's Redis generation key first: a rebuild takes a missing key for a wiped Redis. Not while Redis
    // is wiped and not rebuilt yet, and nothing is written to Postgres if Redis is down (503).
    if (!(await this.holds.markerPresent())) {
      throw DomainError.unavailable('redis', new Error('Redis was wiped and is being rebuilt from Postgres'));
    }
    // A pool that exists already is refused before Redis is touched: while a rebuild runs, its generation is the
    // rebuild's to write, once its Idempotency-Keys are back (RebuildService).
    if (await this.pools.findByName(dto.name)) throw poolExists(dto.name);
    // Pending (set_generation.lua): Redis may be wiped at any moment from the marker's check on, and a generation
    // written into a wiped Redis would let holds be taken there that the rebuild's bump then fences. No reserve or
    // import takes a pending key.
    await this.holds.setGeneration(dto.name, 0, 'pending');
    const pool = await this.pools
      .insert({ name: dto.name, kind: dto.kind, holdTtlMs, maxHoldTtlMs, maxHoldsPerOwner: dto.maxHoldsPerOwner ?? null })
      .catch((err: unknown) => {
        // The insert may have committed with its answer lost: its key is finalized later if its row is there.
        if (err instanceof DomainError && err.code === ErrorCode.DEPENDENCY_UNAVAILABLE) this.finalizeLaterOn(dto.name, err);
        throw err;
      });
    if (!pool) throw poolExists(dto.name);
    // The pool exists from here on: should Redis or Postgres fail now, the answer is still 201, and the key is
    // finalized by the sweeper's upkeep (until then, the pool answers as one that is being rebuilt).
    await this.finalizeGeneration(pool.name).catch((err: unknown) => this.finalizeLaterOn(pool.name, err));
    this.catalog.remember(pool);
    return toPoolDto(pool);
  }

  /**
   * A new pool's generation key, after its insert. Written pending again, should Redis have been wiped since and
   * rebuilt from a pool list read before the insert: the key would be gone, nothing would write it again, and a later
   * rebuild would take that for a wipe and fence every live hold. Then finalized with the generation Postgres has
   * after the marker is seen: a wipe before that has been answered by a rebuild that bumped it (or the marker is
   * missing, and the rebuild to come lists this pool, whose row is in, and writes its key over the pending one); a
   * wipe after it is one the next bump answers.
   */
  private async finalizeGeneration(name: string): Promise<void> {
    await this.holds.setGeneration(name, 0, 'pending');
    if (await this.holds.markerPresent()) await this.holds.setGeneration(name, await this.generations.current(), 'finalize');
  }

  /** Pools this instance created, or may have, whose generation key it could not finalize (Redis or Postgres out). */
  private readonly unfinalized = new Later<string>(MAX_UNFINALIZED);

  private finalizeLaterOn(name: string, err: unknown): void {
    this.logger.warn(`pool "${name}" may be created; its Redis generation is written later: ${String(err)}`);
    if (!this.unfinalized.add(name, name)) {
      this.logger.warn(`more than ${MAX_UNFINALIZED} new pools wait for their generation; "${name}" waits for a rebuild`);
    }
  }

  /** Pools whose generation key this instance has seen final. */
  private readonly settled = new Set<string>();

  /**
   * Run by the sweeper's upkeep. Finalizes the generation keys of pools this instance created, or may have, while
   * Redis or Postgres failed (those whose row is there). Then looks at the key of every pool it knows, at most
   * SETTLE_BATCH a pass, until it has seen it final: one its creator left pending for PENDING_GENERATION_MS (it died
   * or stalled before it finalized it) is finalized, which no rebuild would do with
   * RECONCILE_INTERVAL_MS 0. Returns how many it finalized, and how many keys it found missing with Redis rebuilt (a
   * wipe whose rebuild listed the pools before the pool's row, its creator dead before its second write; or a wipe of
   * part of Redis): the caller has a rebuild run, which takes that for a wipe (a new generation) and writes them.
   */
  async finalizeLater(): Promise<{ finalized: number; missing: number }> {
    let finalized = 0;
    await this.unfinalized.retry(async (name) => {
      if (!(await this.pools.findByName(name))) return; // its insert did not land
      await this.finalizeGeneration(name);
      finalized++;
    });
    let missing = 0;
    // Young ones too: a pending key's age is judged by its own stamp, on Redis' clock (finalizeStale). (Judged by the
    // row's createdAt, Postgres' clock, against this instance's, one whose clock was behind waited that much longer.)
    const due = this.catalog
      .known()
      .filter((pool) => !this.settled.has(pool.name))
      .slice(0, SETTLE_BATCH);
    if (due.length === 0) return { finalized, missing };
    // The generation read after the marker is seen (as a create reads it): the keys looked at were written before.
    const state = await this.holds.rebuildState();
    if (state === 'missing') return { finalized, missing }; // the rebuild to come writes every key
    const generation = await this.generations.current();
    const keyless: string[] = [];
    for (const pool of due) {
      const how = await this.holds.finalizeStale(pool.name, generation);
      if (how === 'young') continue;
      // (Not while a rebuild runs: it writes each pool's key once its Idempotency-Keys are back.)
      if (how === 'missing') {
        if (state === 'rebuilt') keyless.push(pool.name);
        continue;
      }
      this.settled.add(pool.name);
      if (how === 'finalized') {
        this.logger.warn(`pool "${pool.name}": its creator left its Redis generation pending; finalized`);
        finalized++;
      }
    }
    // A young pool's key may be missing for a moment while its creator lives (a wipe between its first pending write
    // and its second, the rebuild having listed the pools before its row): left to the creator for
    // PENDING_GENERATION_MS, by Postgres' own clock.
    if (keyless.length > 0) missing = (await this.pools.createdBefore(keyless, PENDING_GENERATION_MS)).length;
    return { finalized, missing };
  }

  async list(): Promise<PoolDto[]> {
    return (await this.catalog.all()).map(toPoolDto);
  }

  async get(name: string): Promise<PoolWithStatsDto> {
    const pool = await this.catalog.get(name);
    const [counts, free] = await Promise.all([this.pools.counts(pool.id), this.holds.freeCount(pool.name)]);
    const unallocated = counts.total - counts.allocated;
    const freeNow = Math.min(free, unallocated);
    return {
      ...toPoolDto(pool),
      stats: { total: counts.total, free: freeNow, held: unallocated - freeNow, allocated: counts.allocated },
    };
  }

  async importResources(name: string, dto: ImportResourcesDto): Promise<ImportResultDto> {
    const pool = await this.catalog.get(name);
    // Fail before writing anything if Redis is down: new items must be reservable at once.
    const read = await this.beforeRead();
    // A value given twice in one request is imported once, as given first.
    const byValue = new Map<string, NewResource>();
    for (const i of dto.items) {
      if (!byValue.has(i.value)) byValue.set(i.value, { value: i.value, attributes: i.attributes ?? {}, groupKey: i.groupKey ?? null });
    }
    const rows = await this.whenLost(
      pool.name,
      () => [...byValue.keys()].map((value) => `value:${value}`),
      () => this.resources.insertMany(pool.id, [...byValue.values()]),
    );
    const items = rows.map(({ id, value }) => {
      const { attributes, groupKey } = byValue.get(value)!;
      return toCachedItem({ id, value, version: 0, attributes, groupKey });
    });
    if (rows.length < byValue.size) {
      // Values already in the pool: an earlier import of them may have committed without reaching Redis (its
      // Redis step failed, or its answer was lost and this is the caller's retry). Those still free are
      // indexed again; the scripts leave alone what is held or indexed already.
      const inserted = new Set(rows.map((row) => row.value));
      const known = await this.resources.findFreeByValues(
        pool.id,
        [...byValue.keys()].filter((value) => !inserted.has(value)),
      );
      items.push(...known.filter((row) => isStringRecord(row.attributes)).map(toCachedItem));
    }
    await this.indexFreeOrLater(pool, read, items, 'imported');
    return { inserted: rows.length, duplicates: dto.items.length - rows.length };
  }

  async getResource(name: string, id: string): Promise<ResourceDto> {
    const pool = await this.catalog.get(name);
    const row = await this.resources.findById(pool.id, id);
    if (!row) throw resourceNotFound(pool.name, id);
    let state: ResourceDto['state'] = 'allocated';
    if (row.state !== RESOURCE_ALLOCATED) {
      const holder = await this.holds.holder(pool.name, id);
      state = holder && !isAllocationTombstone(holder) ? 'held' : 'free';
    }
    return toResourceDto(pool.name, row, state);
  }

  /**
   * `leases`: false for a caller that acts for one owner (a key bound to it): an item a task lease's completion allocated
   * to a reviewer of the same name is not its to release (owners and reviewers share one space of names).
   */
  async releaseResource(name: string, id: string, owner: string, leases = true): Promise<ResourceDto> {
    const pool = await this.catalog.get(name);
    // Only a task pool has leases.
    leases ||= pool.kind !== 'task';
    const read = await this.beforeRead();
    const row = await this.whenLost(
      pool.name,
      () => [`id:${id}`],
      () => this.resources.release(pool.id, id, owner, leases),
    );
    if (!row) {
      const existing = await this.resources.findById(pool.id, id);
      if (!existing) throw resourceNotFound(pool.name, id);
      if (
        !leases &&
        existing.state === RESOURCE_ALLOCATED &&
        existing.owner === owner &&
        (await this.resources.allocatedByLease(pool.id, id))
      ) {
        throw new DomainError(
          ErrorCode.NOT_ALLOCATED,
          `resource ${id} is allocated to the reviewer "${owner}" by a completed task, not to an owner: a key bound to an owner cannot release it`,
          { resourceId: id, owner },
        );
      }
      // Free already: perhaps released by this caller before, without reaching Redis (its Redis step failed,
      // or its answer was lost and this is the retry). Indexed again; the scripts leave a held item alone.
      if (existing.state === RESOURCE_FREE && isStringRecord(existing.attributes)) {
        await this.indexFreeOrLater(pool, read, [toCachedItem(existing)], 'released');
        await this.finishLandedCommit(pool, id);
      }
      throw new DomainError(ErrorCode.NOT_ALLOCATED, `resource ${id} is not allocated to "${owner}"`, { resourceId: id, owner });
    }
    await this.indexFreeOrLater(pool, read, [toCachedItem(row)], 'released');
    await this.finishLandedCommit(pool, id);
    return toResourceDto(pool.name, row, 'free');
  }

  /**
   * A released item still under the pinned hold of the reservation that allocated it: that confirm's commit
   * landed, but its Redis step failed, and the sweeper finishes it only once the commit window is over (15 s by
   * default). Finished now from the commit row, so the item is reservable at once, as API.md promises. Should
   * that fail too, the sweeper still does it.
   */
  private async finishLandedCommit(pool: PoolEntity, id: string): Promise<void> {
    try {
      const holder = await this.holds.holder(pool.name, id);
      if (holder && !isAllocationTombstone(holder)) await this.committer.finishIfLanded(pool, holder);
    } catch (err) {
      this.logger.warn(`released ${id} of "${pool.name}", still under a finished commit's hold; the sweeper frees it: ${String(err)}`);
    }
  }

  /**
   * indexFree, and when Redis cannot take the items now, remembered for the sweeper's upkeep to index
   * (reindexPending): they are free in Postgres, committed, and must become reservable without waiting
   * for the periodic rebuild (or, with RECONCILE_INTERVAL_MS 0, for a restart).
   */
  private async indexFreeOrLater(pool: PoolEntity, read: ReadStamp, items: CachedItem[], what: string): Promise<void> {
    if (items.length === 0) return;
    let indexed = false;
    try {
      indexed = await this.indexFree(pool, read, items);
    } catch (err) {
      this.logger.warn(`${what} ${items.length} items of "${pool.name}" but could not index them in Redis yet: ${String(err)}`);
    }
    if (!indexed)
      this.rememberUnindexed(
        pool.name,
        items.map((item) => `id:${item.id}`),
      );
  }

  /**
   * A Postgres write that makes items free (an import, a release), answered 503 when Postgres could not be
   * reached: it may have committed all the same (its answer lost with the connection), and nobody would index
   * the items it freed. They are remembered, to be indexed if Postgres says they are free (reindexPending).
   */
  private async whenLost<T>(pool: string, keys: () => string[], write: () => Promise<T>): Promise<T> {
    try {
      return await write();
    } catch (err) {
      if (err instanceof DomainError && err.code === ErrorCode.DEPENDENCY_UNAVAILABLE) this.rememberUnindexed(pool, keys());
      throw err;
    }
  }

  private rememberUnindexed(pool: string, keys: string[]): void {
    const pending = this.unindexed.get(pool) ?? new Set<string>();
    this.unindexed.set(pool, pending);
    let room = MAX_UNINDEXED - [...this.unindexed.values()].reduce((n, set) => n + set.size, 0);
    for (const key of keys) {
      if (pending.has(key)) continue;
      if (room-- <= 0) {
        this.logger.warn(`more than ${MAX_UNINDEXED} free items wait to be indexed in Redis; the next rebuild adds the rest`);
        break;
      }
      pending.add(key);
    }
  }

  /**
   * Indexes the free items that an import or a release of this instance committed but could not index
   * (Redis down or too slow then), from what Postgres says of them now. Run by the sweeper's upkeep.
   */
  async reindexPending(): Promise<number> {
    let added = 0;
    for (const [name, pending] of [...this.unindexed]) {
      const keys = [...pending].slice(0, REINDEX_BATCH);
      const ids = keys.filter((key) => key.startsWith('id:')).map((key) => key.slice(3));
      const values = keys.filter((key) => key.startsWith('value:')).map((key) => key.slice(6));
      const pool = await this.catalog.get(name);
      const { readAt, generation } = await this.beforeRead();
      const rows = [
        ...(ids.length > 0 ? await this.resources.findMany(pool.id, ids) : []),
        ...(values.length > 0 ? await this.resources.findFreeByValues(pool.id, values) : []),
      ];
      const free = rows.filter((row) => row.state === RESOURCE_FREE && isStringRecord(row.attributes)).map(toCachedItem);
      // A write whose answer was lost may have committed after the generation was read: read again if it moved on.
      const page = await this.holds.addFree(pool.name, generation, readAt, free, 'readAgain');
      if (page === null) continue; // this instance stalled after the read, or Redis was rebuilt: read again next time
      for (const key of keys) pending.delete(key);
      if (pending.size === 0) this.unindexed.delete(name);
      added += page;
    }
    return added;
  }

  /**
   * Both stamps a Postgres read (or a write that returns rows) needs before Redis may take what it found free:
   * Redis' clock, and the Redis generation. Both before the read: the generation fences a read from before a
   * wipe (an item allocated since has lost its tombstone), the clock a stall after it (HoldStore.addFree).
   */
  private async beforeRead(): Promise<ReadStamp> {
    const readAt = await this.holds.clock();
    return { readAt, generation: await this.generations.current() };
  }

  /**
   * Adds items just made free in Postgres (imported, released) to Redis, with the stamps taken before that
   * write. If Redis refuses them (this instance stalled, or Redis was rebuilt since: HoldStore.addFree), the
   * rows are read again.
   */
  private async indexFree(pool: PoolEntity, read: ReadStamp, items: CachedItem[]): Promise<boolean> {
    let { readAt, generation } = read;
    for (let attempt = 1; ; attempt++) {
      if ((await this.holds.addFree(pool.name, generation, readAt, items, 'readAgain')) !== null) return true;
      if (attempt === 3) {
        this.logger.warn(`${items.length} free items of "${pool.name}" were not indexed in Redis (too slow); indexed later`);
        return false;
      }
      ({ readAt, generation } = await this.beforeRead());
      const rows = await this.resources.findMany(
        pool.id,
        items.map((item) => item.id),
      );
      items = rows.filter((row) => row.state === RESOURCE_FREE && isStringRecord(row.attributes)).map(toCachedItem);
    }
  }
}

/** Taken before a Postgres read: see PoolsService.beforeRead. */
interface ReadStamp {
  readAt: number;
  generation: number;
}

function resourceNotFound(pool: string, id: string): DomainError {
  return new DomainError(ErrorCode.RESOURCE_NOT_FOUND, `resource ${id} does not exist in pool "${pool}"`, { pool, resourceId: id });
}

function toResourceDto(pool: string, row: ResourceRow, state: ResourceDto['state']): ResourceDto {
  return {
    id: row.id,
    pool,
    value: row.value,
    state,
    version: row.version,
    owner: row.owner,
    attributes: row.attributes,
    groupKey: row.groupKey,
    updatedAt: new Date(row.updatedAt).toISOString(),
  };
}

function poolExists(pool: string): DomainError {
  return new DomainError(ErrorCode.POOL_EXISTS, `pool "${pool}" already exists`, { pool });
}
