import { ApiProperty, ApiPropertyOptional } from '@nestjs/swagger';
import { Type } from 'class-transformer';
import {
  ArrayMaxSize,
  ArrayMinSize,
  ArrayUnique,
  IsArray,
  IsInt,
  IsObject,
  IsString,
  Matches,
  Max,
  Min,
  ValidateNested,
} from 'class-validator';
import { IsCharLength, IsFlatStringRecord, IsResourceId, Omittable } from '../common/validators.js';
import { MAX_TTL_MS } from '../pools/pool.dto.js';
import { RESERVATION_ID_PATTERN } from '../redis/keys.js';

/**
 * What a confirm's `released` lists. A late confirm's (after expiry) other items went back to the pool at the expiry,
 * and another caller may hold or own one since; the list stays the same for every repeat of the confirm.
 */
const RELEASED =
  "the ids of the reservation's items not chosen, returned to the pool (by this confirm, or at the reservation's expiry " +
  'for a confirm that came after it: another caller may hold one since)';

export const RESERVATION_STATES = ['held', 'confirmed', 'released', 'expired'] as const;
export type ReservationState = (typeof RESERVATION_STATES)[number];

export class ReservationParams {
  @ApiProperty({
    description: 'Reservation id, as returned by reserve',
    example: 'phone-bj.9b2d7c1e-1f7a-4c55-9a43-2b0f6f1d2e11',
    pattern: RESERVATION_ID_PATTERN,
  })
  @Matches(new RegExp(RESERVATION_ID_PATTERN), { message: 'id is not a reservation id' })
  id: string;
}

export class ReservationFilterDto {
  @ApiPropertyOptional({
    description: 'Only items whose attributes include all of these key/value pairs (at most 32, keys of 1 to 64 characters)',
    type: 'object',
    additionalProperties: { type: 'string' },
    example: { city: 'bj' },
  })
  @Omittable()
  @IsFlatStringRecord()
  attributes?: Record<string, string>;

  @ApiPropertyOptional({ description: 'Only items whose value starts with this prefix', example: '138', maxLength: 256 })
  @Omittable()
  @IsString()
  @IsCharLength(1, 256)
  valuePrefix?: string;
}

export class CreateReservationDto {
  @ApiProperty({ description: 'Who the items are held for', minLength: 1, maxLength: 128, example: 'user-123' })
  @IsString()
  @IsCharLength(1, 128)
  owner: string;

  @ApiPropertyOptional({ description: 'How many items to hold, all or nothing', default: 1, minimum: 1, maximum: 100 })
  @Omittable()
  @IsInt()
  @Min(1)
  @Max(100)
  count?: number;

  @ApiPropertyOptional({ description: "Hold time, ms: 1000 to the pool's maxHoldTtlMs; default the pool's holdTtlMs", minimum: 1000 })
  @Omittable()
  @IsInt()
  @Min(1000)
  @Max(MAX_TTL_MS)
  ttlMs?: number;

  @ApiPropertyOptional({
    description:
      'How long to wait for free items, ms (0-30000). While fewer than `count` match, the reserve tries again when ' +
      'it is woken by items matching its filter coming free in the pool, and otherwise every 25-375 ms (while wake-ups are down, the first in ' +
      'line at most every 75 ms, for up to 64 such waiters an instance), until it holds them or waitMs has passed ' +
      '(then 409 POOL_EXHAUSTED). Reserves that wait with the same filter (none, ' +
      'one attribute alone, or a valuePrefix alone) are served in the order they began to wait, on any instance, first ' +
      'fit: a later waiter gets only the items that the live waiters among the first 64 in line cannot use now. A reserve without waitMs, one with ' +
      'another filter, and one whose filter has several conditions (which has no turn) take whatever is free. A filter ' +
      'too rare to be searched in full, a replayed Idempotency-Key and the owner quota answer at once.',
    default: 0,
    minimum: 0,
    maximum: 30_000,
  })
  @Omittable()
  @IsInt()
  @Min(0)
  @Max(30_000)
  waitMs?: number;

  @ApiPropertyOptional({ description: 'Restrict the items that may be held', type: ReservationFilterDto })
  @Omittable()
  @IsObject()
  @ValidateNested()
  @Type(() => ReservationFilterDto)
  filter?: ReservationFilterDto;
}

export class ReservationItemDto {
  @ApiProperty({ description: 'Resource id', example: '5780' })
  resourceId: string;

  @ApiProperty({ description: 'The item', example: '13800138000' })
  value: string;

  @ApiProperty({ type: 'integer', description: 'Row version the hold was taken at; confirm commits only if it is unchanged' })
  version: number;

  @ApiProperty({ description: 'Attributes of the item', type: 'object', additionalProperties: { type: 'string' } })
  attributes: Record<string, string>;
}

export class AllocatedItemDto {
  @ApiProperty({ description: 'Resource id' })
  resourceId: string;

  @ApiProperty({ description: 'The item' })
  value: string;

  @ApiProperty({ type: 'integer', description: 'Row version after the allocation' })
  version: number;
}

export class ReservationDto {
  @ApiProperty({ description: 'Reservation id (opaque, unguessable)' })
  id: string;

  @ApiProperty({ description: 'Pool name' })
  pool: string;

  @ApiProperty({ description: 'Who the items are held for' })
  owner: string;

  @ApiProperty({ description: 'held, confirmed, released or expired', enum: RESERVATION_STATES })
  state: ReservationState;

  @ApiProperty({ description: 'The items held', type: [ReservationItemDto] })
  items: ReservationItemDto[];

  @ApiProperty({ description: 'When the hold ends unless confirmed or extended (ISO-8601 UTC, Redis server clock)', format: 'date-time' })
  expiresAt: string;

  @ApiPropertyOptional({ description: 'After confirm: the items allocated to the owner', type: [AllocatedItemDto] })
  allocated?: AllocatedItemDto[];

  @ApiPropertyOptional({ description: `After confirm: ${RELEASED}`, type: [String] })
  released?: string[];
}

export class ConfirmDto {
  @ApiProperty({
    description: 'The ids of the items to allocate (1-100, each held by this reservation; an id is 1 to 9223372036854775807)',
    type: [String],
    example: ['5780'],
  })
  @IsArray()
  @ArrayMinSize(1)
  @ArrayMaxSize(100)
  @ArrayUnique()
  @IsResourceId({ each: true })
  resourceIds: string[];
}

export class ConfirmResultDto {
  @ApiProperty({ description: 'Reservation id' })
  id: string;

  @ApiProperty({ description: 'Always `confirmed`', enum: ['confirmed'] })
  state: 'confirmed';

  @ApiProperty({ description: 'Items allocated to the owner, with their new version', type: [AllocatedItemDto] })
  allocated: AllocatedItemDto[];

  @ApiProperty({ description: RELEASED.charAt(0).toUpperCase() + RELEASED.slice(1), type: [String] })
  released: string[];
}

export class ExtendDto {
  @ApiProperty({ description: "New hold time from now, ms (capped by the pool's maxHoldTtlMs)", minimum: 1000 })
  @IsInt()
  @Min(1000)
  // Any larger value is capped by the pool's maxHoldTtlMs, not refused (API.md); this only keeps it exact.
  @Max(Number.MAX_SAFE_INTEGER)
  ttlMs: number;
}
