import { CachedItem, StoredReservation } from '../redis/hold-store.repository.js';
import { CommitOutcome } from './commit.service.js';
import { ConfirmResultDto, ReservationDto, ReservationItemDto, ReservationState } from './reservation.dto.js';

/** The API state of a stored reservation, judged on the Redis clock. */
export function apiState(r: Pick<StoredReservation, 'state' | 'expiresMs' | 'nowMs'>): ReservationState {
  switch (r.state) {
    case 'held':
      return r.nowMs >= r.expiresMs ? 'expired' : 'held';
    case 'confirming':
      return 'held';
    default:
      return r.state;
  }
}

/** An item as a reservation shows it; the cache leaves empty attributes out. */
function toItemDto(i: CachedItem): ReservationItemDto {
  return { resourceId: i.id, value: i.v, version: i.n, attributes: i.a ?? {} };
}

export function toReservationDto(pool: string, r: StoredReservation): ReservationDto {
  const dto: ReservationDto = {
    id: r.id,
    pool,
    owner: r.owner,
    state: apiState(r),
    items: r.items.map(toItemDto),
    expiresAt: new Date(r.expiresMs).toISOString(),
  };
  if (r.state === 'confirmed' && r.outcome) {
    const outcome = r.outcome as unknown as CommitOutcome;
    dto.allocated = outcome.allocated;
    dto.released = outcome.released;
  }
  return dto;
}

/** A confirmed reservation rebuilt from its Postgres commit row (Redis lost it). */
export function committedReservationDto(pool: string, id: string, outcome: CommitOutcome): ReservationDto {
  return {
    id,
    pool,
    owner: outcome.owner,
    state: 'confirmed',
    items: outcome.items.map(toItemDto),
    expiresAt: new Date(outcome.expiresMs).toISOString(),
    allocated: outcome.allocated,
    released: outcome.released,
  };
}

export function toConfirmResult(id: string, outcome: CommitOutcome): ConfirmResultDto {
  return { id, state: 'confirmed', allocated: outcome.allocated, released: outcome.released };
}
