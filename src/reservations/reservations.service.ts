import { Injectable } from '@nestjs/common';
import { randomUUID } from 'node:crypto';
import { DomainError, ErrorCode } from '../common/errors.js';
import { bodyHash } from '../common/stable-json.js';
import { PoolEntity } from '../database/entities.js';
import { MetricsService } from '../metrics/metrics.service.js';
import { PoolCatalog } from '../pools/pool-catalog.service.js';
import { HoldStore, ReserveRequest, StoredReservation } from '../redis/hold-store.repository.js';
import { makeReservationId, poolOfReservationId } from '../redis/keys.js';
import { CommitService, notFound } from './commit.service.js';
import { ConfirmResultDto, CreateReservationDto, ReservationDto } from './reservation.dto.js';
import { committedReservationDto, toConfirmResult, toReservationDto } from './reservation.view.js';

/** An Idempotency-Key: 1-255 visible ASCII characters. */
export const IDEMPOTENCY_KEY = /^[\x21-\x7e]{1,255}$/;

export interface ReserveAnswer {
  /** false when an Idempotency-Key replayed an earlier reservation (200 instead of 201). */
  created: boolean;
  reservation: ReservationDto;
}

/** Resolves the pool a reservation id belongs to. */
export async function poolOf(catalog: PoolCatalog, reservationId: string): Promise<PoolEntity> {
  const name = poolOfReservationId(reservationId);
  if (!name) throw notFound(reservationId);
  try {
    return await catalog.get(name);
  } catch (err) {
    if (err instanceof DomainError && err.code === ErrorCode.POOL_NOT_FOUND) throw notFound(reservationId);
    throw err;
  }
}

/** Checks a hold time against the pool; shared by reservations and task leases. */
export function holdTtl(pool: PoolEntity, requested: number | undefined, field: string): number {
  const ttl = requested ?? pool.holdTtlMs;
  if (ttl > pool.maxHoldTtlMs) {
    throw DomainError.validation([{ field, reason: `${field} must not be greater than the pool's maxHoldTtlMs (${pool.maxHoldTtlMs})` }]);
  }
  return ttl;
}

@Injectable()
export class ReservationsService {
  constructor(
    private readonly catalog: PoolCatalog,
    private readonly holds: HoldStore,
    private readonly committer: CommitService,
    private readonly metrics: MetricsService,
  ) {}

  async reserve(poolName: string, dto: CreateReservationDto, idempotencyKey: string | undefined): Promise<ReserveAnswer> {
    if (idempotencyKey !== undefined && !IDEMPOTENCY_KEY.test(idempotencyKey)) {
      throw DomainError.validation([{ field: 'Idempotency-Key', reason: 'Idempotency-Key must be 1-255 visible ASCII characters' }]);
    }
    if (dto.waitMs !== undefined && dto.waitMs > 0) {
      throw DomainError.validation([
        { field: 'waitMs', reason: 'waiting for free items (waitMs above 0) is not supported yet; send 0 or omit it' },
      ]);
    }
    const pool = await this.catalog.get(poolName);
    const count = dto.count ?? 1;
    const request: ReserveRequest = {
      reservationId: makeReservationId(pool.name, randomUUID()),
      owner: dto.owner,
      count,
      ttlMs: holdTtl(pool, dto.ttlMs, 'ttlMs'),
      maxHoldsPerOwner: pool.maxHoldsPerOwner ?? 0,
      kind: 'r',
      idempotencyKey,
      bodyHash: idempotencyKey === undefined ? undefined : bodyHash(dto),
      attributes: dto.filter?.attributes,
      valuePrefix: dto.filter?.valuePrefix,
      groupAffinity: false,
    };
    const result = await this.holds.reserve(pool.name, request);
    this.metrics.reservations.inc({ pool: pool.name, outcome: result.status });
    switch (result.status) {
      case 'ok':
        return { created: true, reservation: toReservationDto(pool.name, result.reservation) };
      case 'replay':
        return { created: false, reservation: toReservationDto(pool.name, await this.settledView(pool, result.reservation)) };
      case 'exhausted':
        if (result.limited) {
          throw new DomainError(
            ErrorCode.POOL_EXHAUSTED,
            `fewer than ${count} free items match among the candidates looked at in pool "${pool.name}": this filter matches ` +
              'too rarely to be searched in full; narrow it (a longer valuePrefix, fewer attributes) or try again',
            { pool: pool.name, count, searchLimited: true },
          );
        }
        throw new DomainError(ErrorCode.POOL_EXHAUSTED, `fewer than ${count} free items match in pool "${pool.name}"`, {
          pool: pool.name,
          count,
        });
      case 'quota':
        throw new DomainError(
          ErrorCode.OWNER_QUOTA_EXCEEDED,
          `"${dto.owner}" holds ${result.held} items; the pool allows ${pool.maxHoldsPerOwner} per owner`,
          { held: result.held, maxHoldsPerOwner: pool.maxHoldsPerOwner },
        );
      case 'reused':
        throw new DomainError(ErrorCode.IDEMPOTENCY_KEY_REUSED, 'this Idempotency-Key was sent before with a different body', {
          idempotencyKey,
        });
    }
  }

  async get(id: string): Promise<ReservationDto> {
    const pool = await poolOf(this.catalog, id);
    const stored = await this.holds.read(pool.name, id);
    if (stored) return toReservationDto(pool.name, await this.settledView(pool, stored));
    const committed = await this.committer.landedCommit(id);
    if (committed) return committedReservationDto(pool.name, id, committed);
    throw notFound(id);
  }

  /**
   * A reservation in the middle of a commit (pinned, or held again after a commit that got no answer) may be
   * confirmed in Postgres already (its Redis step failed, or is on its way): then it is finished now, and shown
   * confirmed. Shown as Redis has it when Postgres cannot be asked.
   */
  private async settledView(pool: PoolEntity, r: StoredReservation): Promise<StoredReservation> {
    if (r.epoch === 0 || (r.state !== 'confirming' && r.state !== 'held')) return r;
    const landed = await this.committer.finishIfLanded(pool, r.id).catch(() => null);
    return (landed && (await this.holds.read(pool.name, r.id))) || r;
  }

  async extend(id: string, ttlMs: number): Promise<ReservationDto> {
    const pool = await poolOf(this.catalog, id);
    const stored = await this.extendHold(pool, id, ttlMs);
    return toReservationDto(pool.name, stored);
  }

  /** Extend and heartbeat: expiresAt = now + ttl, capped by the pool's maxHoldTtlMs. */
  async extendHold(pool: PoolEntity, id: string, ttlMs: number): Promise<StoredReservation> {
    const result = await this.holds.extend(pool.name, id, Math.min(ttlMs, pool.maxHoldTtlMs));
    switch (result.status) {
      case 'extended':
        return result.reservation;
      case 'expired':
        throw new DomainError(ErrorCode.HOLD_EXPIRED, 'the hold has expired', { id });
      case 'closed':
        throw new DomainError(ErrorCode.RESERVATION_CLOSED, 'the reservation is already confirmed or released', { id });
      case 'missing':
        // Redis no longer has it (retention over, or a wipe): a confirmed one is still known to Postgres.
        if (await this.committer.landedCommit(id)) {
          throw new DomainError(ErrorCode.RESERVATION_CLOSED, 'the reservation is confirmed', { id });
        }
        throw notFound(id);
    }
  }

  async confirm(id: string, resourceIds: string[]): Promise<ConfirmResultDto> {
    const pool = await poolOf(this.catalog, id);
    const outcome = await this.committer.commit(pool, id, resourceIds);
    return toConfirmResult(id, outcome);
  }

  async release(id: string): Promise<ReservationDto> {
    const pool = await poolOf(this.catalog, id);
    return toReservationDto(pool.name, await this.releaseHold(pool, id));
  }

  async releaseHold(pool: PoolEntity, id: string): Promise<StoredReservation> {
    let result = await this.holds.release(pool.name, id);
    if (result.status === 'undecided') {
      // A confirm of it failed without an answer from Postgres: settle that commit first. Landed: the
      // reservation is confirmed now, and the release answers so. Given up: the release goes ahead.
      await this.committer.settle(pool, id, result.epoch);
      result = await this.holds.release(pool.name, id, result.epoch);
    }
    switch (result.status) {
      case 'released':
        return result.reservation;
      case 'confirmed':
        throw new DomainError(ErrorCode.RESERVATION_CLOSED, 'the reservation is confirmed; release its items one by one instead', {
          id,
        });
      case 'undecided':
      case 'busy':
        throw new DomainError(ErrorCode.RESERVATION_CLOSED, 'a confirm of this reservation is in progress', { id });
      case 'missing': {
        if (await this.committer.landedCommit(id)) {
          throw new DomainError(ErrorCode.RESERVATION_CLOSED, 'the reservation is confirmed', { id });
        }
        throw notFound(id);
      }
    }
  }
}
