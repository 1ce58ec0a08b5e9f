import { Injectable } from '@nestjs/common';
import { randomUUID } from 'node:crypto';
import { DomainError, ErrorCode } from '../common/errors.js';
import { PoolEntity } from '../database/entities.js';
import { MetricsService } from '../metrics/metrics.service.js';
import { PoolCatalog } from '../pools/pool-catalog.service.js';
import { HoldStore, StoredReservation } from '../redis/hold-store.repository.js';
import { makeReservationId } from '../redis/keys.js';
import { CommitOutcome, CommitService, isLeaseCommit, notFound } from '../reservations/commit.service.js';
import { ReservationsService, holdTtl, poolOf } from '../reservations/reservations.service.js';
import { HeartbeatResultDto, NextTaskDto, TaskLeaseDto, TaskStateDto } from './task.dto.js';

/** Review tasks: a lease is a one-item reservation whose owner is the reviewer. */
@Injectable()
export class TasksService {
  constructor(
    private readonly catalog: PoolCatalog,
    private readonly holds: HoldStore,
    private readonly committer: CommitService,
    private readonly reservations: ReservationsService,
    private readonly metrics: MetricsService,
  ) {}

  /** The next free task for this reviewer, preferring groups it already works in; null when none is free. */
  async next(poolName: string, dto: NextTaskDto): Promise<TaskLeaseDto | null> {
    const pool = await this.taskPool(poolName);
    const result = await this.holds.reserve(pool.name, {
      reservationId: makeReservationId(pool.name, randomUUID()),
      owner: dto.reviewer,
      count: 1,
      ttlMs: holdTtl(pool, dto.leaseMs, 'leaseMs'),
      maxHoldsPerOwner: pool.maxHoldsPerOwner ?? 0,
      kind: 'l',
      groupAffinity: true,
    });
    this.metrics.reservations.inc({ pool: pool.name, outcome: result.status === 'ok' ? 'leased' : result.status });
    switch (result.status) {
      case 'ok':
      case 'replay':
        return toLease(result.reservation);
      case 'exhausted':
        return null;
      case 'quota':
        throw new DomainError(ErrorCode.OWNER_QUOTA_EXCEEDED, `"${dto.reviewer}" already leases ${result.held} tasks`, {
          held: result.held,
          maxHoldsPerOwner: pool.maxHoldsPerOwner,
        });
      case 'reused':
      case 'landed':
        throw new Error('unreachable: task leases carry no idempotency key');
    }
  }

  async heartbeat(leaseId: string, leaseMs: number | undefined): Promise<HeartbeatResultDto> {
    const pool = await this.leasePool(leaseId);
    // Redis no longer has it: 409 if it is a completed lease (extendHold says so), 404 if it is none.
    if (!(await this.readLease(pool, leaseId))) await this.landedLease(leaseId);
    const lease = await this.reservations.extendHold(pool, leaseId, leaseMs ?? pool.holdTtlMs, 'l');
    return { leaseId, expiresAt: new Date(lease.expiresMs).toISOString() };
  }

  async complete(leaseId: string): Promise<TaskStateDto> {
    const pool = await this.leasePool(leaseId);
    const stored = await this.readLease(pool, leaseId);
    const resourceId = stored?.items[0]?.id;
    if (stored && resourceId) {
      const outcome = await this.committer.commit(pool, leaseId, [resourceId], 'l');
      return { leaseId, resourceId: outcome.allocated[0].resourceId, state: 'completed' };
    }
    // Redis no longer has the lease (retention over, or a wipe): answer from its Postgres commit row, if it was
    // a lease's and completed.
    const committed = await this.landedLease(leaseId);
    return { leaseId, resourceId: committed.allocated[0].resourceId, state: 'completed' };
  }

  async abandon(leaseId: string): Promise<TaskStateDto> {
    const pool = await this.leasePool(leaseId);
    // Redis no longer has it: 409 if it is a completed lease (releaseHold says so), 404 if it is none.
    if (!(await this.readLease(pool, leaseId))) await this.landedLease(leaseId);
    const lease = await this.reservations.releaseHold(pool, leaseId, 'l');
    return { leaseId, resourceId: lease.items[0].id, state: 'abandoned' };
  }

  private async taskPool(name: string): Promise<PoolEntity> {
    const pool = await this.catalog.get(name);
    if (pool.kind !== 'task') {
      throw DomainError.validation([{ field: 'pool', reason: `pool "${name}" is of kind "${pool.kind}", not "task"` }]);
    }
    return pool;
  }

  /**
   * The lease's record in Redis, or null when Redis no longer has it. A reservation made through /reservations
   * on a task pool (of any count) is no lease: the task routes answer 404 for it, as for an unknown id. A
   * record's kind never changes, so reading it before acting on it is safe.
   */
  private async readLease(pool: PoolEntity, leaseId: string): Promise<StoredReservation | null> {
    // (Not waiting for the check of a new connection to Redis, which may take a second: heartbeat and complete act just
    // before the lease ends. The call that acts next waits for it.)
    // Missing, though: read again once the check is done, so that a Redis gone back in time answers 503, not 404.
    const stored = (await this.holds.peek(pool.name, leaseId)) ?? (await this.holds.read(pool.name, leaseId));
    if (stored && stored.kind !== 'l') throw notFound(leaseId);
    return stored;
  }

  /**
   * The commit Postgres recorded for a lease Redis no longer has. A reservation made through /reservations on
   * a task pool is no lease, there too: 404, as for an unknown id or a lease never completed.
   */
  private async landedLease(leaseId: string): Promise<CommitOutcome> {
    const committed = await this.committer.landedCommit(leaseId);
    if (!committed || !isLeaseCommit(committed)) throw notFound(leaseId);
    return committed;
  }

  /** The task pool of a lease id; a reservation of a number pool is no lease (404, as an unknown id). */
  private async leasePool(leaseId: string): Promise<PoolEntity> {
    const pool = await poolOf(this.catalog, leaseId);
    if (pool.kind !== 'task') throw notFound(leaseId);
    return pool;
  }
}

function toLease(r: StoredReservation): TaskLeaseDto {
  const item = r.items[0];
  return {
    leaseId: r.id,
    resourceId: item.id,
    value: item.v,
    groupKey: item.g ?? null,
    attributes: item.a ?? {},
    expiresAt: new Date(r.expiresMs).toISOString(),
  };
}
