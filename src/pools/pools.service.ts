import { Injectable, Logger } from '@nestjs/common';
import { DomainError, ErrorCode } from '../common/errors.js';
import { PoolEntity, RESOURCE_ALLOCATED, RESOURCE_FREE } from '../database/entities.js';
import { GenerationRepository } from '../database/generation.repository.js';
import { PoolRepository } from '../database/pool.repository.js';
import { NewResource, ResourceRepository, ResourceRow } from '../database/resource.repository.js';
import { isAllocationTombstone } from '../redis/keys.js';
import { isStringRecord } from '../common/validators.js';
import { CachedItem, HoldStore } from '../redis/hold-store.repository.js';
import { PoolCatalog } from './pool-catalog.service.js';
import { CreatePoolDto, ImportResourcesDto, ImportResultDto, PoolDto, PoolWithStatsDto, ResourceDto } from './pool.dto.js';

export const DEFAULT_HOLD_TTL_MS = 600_000;
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

export function toCachedItem(row: Pick<ResourceRow, 'id' | 'value' | 'version' | 'groupKey' | 'attributes'>): CachedItem {
  const item: CachedItem = { id: row.id, v: row.value, n: row.version };
  if (row.groupKey !== null) item.g = row.groupKey;
  if (Object.keys(row.attributes).length > 0) item.a = row.attributes;
  return item;
}

@Injectable()
export class PoolsService {
  private readonly logger = new Logger(PoolsService.name);

  constructor(
    private readonly pools: PoolRepository,
    private readonly resources: ResourceRepository,
    private readonly catalog: PoolCatalog,
    private readonly holds: HoldStore,
    private readonly generations: GenerationRepository,
  ) {}

  async create(dto: CreatePoolDto): Promise<PoolDto> {
    const holdTtlMs = dto.holdTtlMs ?? DEFAULT_HOLD_TTL_MS;
    // API.md's default, whatever holdTtlMs is: a longer holdTtlMs needs maxHoldTtlMs sent with it.
    const maxHoldTtlMs = dto.maxHoldTtlMs ?? DEFAULT_MAX_HOLD_TTL_MS;
    if (holdTtlMs > maxHoldTtlMs) {
      const given = dto.maxHoldTtlMs === undefined ? `, its default; send a maxHoldTtlMs of at least ${holdTtlMs}` : '';
      throw DomainError.validation([
        { field: 'holdTtlMs', reason: `holdTtlMs must not be greater than maxHoldTtlMs (${maxHoldTtlMs}${given})` },
      ]);
    }
    // The pool's Redis generation first: a rebuild takes a missing key for a wiped Redis. Not while Redis
    // is wiped and not rebuilt yet (the rebuild would bump the generation read now), and nothing is
    // written to Postgres if Redis is down (503).
    if (!(await this.holds.markerPresent())) {
      throw DomainError.unavailable('redis', new Error('Redis was wiped and is being rebuilt from Postgres'));
    }
    await this.holds.setGeneration(dto.name, await this.generations.current(), 'ifMissing');
    const pool = await this.pools.insert({
      name: dto.name,
      kind: dto.kind,
      holdTtlMs,
      maxHoldTtlMs,
      maxHoldsPerOwner: dto.maxHoldsPerOwner ?? null,
    });
    if (!pool) throw new DomainError(ErrorCode.POOL_EXISTS, `pool "${dto.name}" already exists`, { pool: dto.name });
    // Redis wiped between the key's write and the insert, and rebuilt from a pool list read before the
    // insert: the key is gone, and nothing writes it again; a later rebuild would take that for a wipe
    // and fence every live hold. Written again in the current generation: a rebuild that bumps it after
    // this read lists the pool (its row is in) and writes the newer one over it.
    await this.holds.setGeneration(pool.name, await this.generations.current(), 'ifMissing');
    this.catalog.remember(pool);
    return toPoolDto(pool);
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
    const readAt = await this.holds.clock();
    // A value given twice in one request is imported once, as given first.
    const byValue = new Map<string, NewResource>();
    for (const i of dto.items) {
      if (!byValue.has(i.value)) byValue.set(i.value, { value: i.value, attributes: i.attributes ?? {}, groupKey: i.groupKey ?? null });
    }
    const rows = await this.resources.insertMany(pool.id, [...byValue.values()]);
    try {
      const items = rows.map(({ id, value }) => toCachedItem({ id, version: 0, ...byValue.get(value)! }));
      await this.indexFree(pool, readAt, items);
    } catch (err) {
      // The rows are committed; the reconciler adds them to Redis once it is back.
      this.logger.warn(`imported ${rows.length} items into "${pool.name}" but could not index them in Redis: ${String(err)}`);
    }
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

  async releaseResource(name: string, id: string, owner: string): Promise<ResourceDto> {
    const pool = await this.catalog.get(name);
    const readAt = await this.holds.clock();
    const row = await this.resources.release(pool.id, id, owner);
    if (!row) {
      const existing = await this.resources.findById(pool.id, id);
      if (!existing) throw resourceNotFound(pool.name, id);
      throw new DomainError(ErrorCode.NOT_ALLOCATED, `resource ${id} is not allocated to "${owner}"`, { resourceId: id, owner });
    }
    try {
      await this.indexFree(pool, readAt, [toCachedItem(row)]);
    } catch (err) {
      this.logger.warn(`released resource ${id} of "${pool.name}" but could not index it in Redis: ${String(err)}`);
    }
    return toResourceDto(pool.name, row, 'free');
  }

  /**
   * Adds items just made free in Postgres (imported, released) to Redis. `readAt` is Redis' clock before that
   * write: if this instance stalled so long that Redis refuses it (HoldStore.addFree), the rows are read again.
   */
  private async indexFree(pool: PoolEntity, readAt: number, items: CachedItem[]): Promise<void> {
    let generation = await this.generations.current();
    for (let attempt = 1; ; attempt++) {
      if ((await this.holds.addFree(pool.name, generation, readAt, items)) !== null) return;
      if (attempt === 3) {
        this.logger.warn(`${items.length} free items of "${pool.name}" were not indexed in Redis (too slow); the next rebuild adds them`);
        return;
      }
      // Both before the read: the generation fences a read from before a wipe, the clock a stall after it.
      readAt = await this.holds.clock();
      generation = await this.generations.current();
      const rows = await this.resources.findMany(
        pool.id,
        items.map((item) => item.id),
      );
      items = rows.filter((row) => row.state === RESOURCE_FREE && isStringRecord(row.attributes)).map(toCachedItem);
    }
  }
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
