import { ApiProperty, ApiPropertyOptional } from '@nestjs/swagger';
import { Type } from 'class-transformer';
import {
  ArrayMaxSize,
  ArrayMinSize,
  IsArray,
  IsIn,
  IsInt,
  IsObject,
  IsOptional,
  IsString,
  Matches,
  Max,
  Min,
  ValidateNested,
} from 'class-validator';
import {
  IsCharLength,
  IsFlatStringRecord,
  IsResourceId,
  MAX_IMPORT_ITEMS,
  Omittable,
  POOL_NAME,
  RESOURCE_ID,
} from '../common/validators.js';

export const POOL_KINDS = ['number', 'task'] as const;
export type PoolKind = (typeof POOL_KINDS)[number];
export const MAX_TTL_MS = 7 * 86_400_000;

export class PoolParams {
  @ApiProperty({ description: 'Pool name', pattern: POOL_NAME.source, example: 'phone-bj' })
  @Matches(POOL_NAME, { message: 'pool must match ^[a-z0-9][a-z0-9_-]{0,62}$' })
  pool: string;
}

export class ResourceParams extends PoolParams {
  @ApiProperty({
    description: 'Resource id (a Postgres bigint, as a string): 1 to 9223372036854775807',
    example: '5780',
    pattern: RESOURCE_ID.source,
  })
  @IsResourceId()
  id: string;
}

export class CreatePoolDto {
  @ApiProperty({ description: 'Unique pool name', pattern: POOL_NAME.source, example: 'phone-bj' })
  @IsString()
  @Matches(POOL_NAME, { message: 'name must match ^[a-z0-9][a-z0-9_-]{0,62}$' })
  name: string;

  @ApiProperty({ description: 'What the pool hands out: `number` (reservations) or `task` (review leases)', enum: POOL_KINDS })
  @IsIn(POOL_KINDS)
  kind: PoolKind;

  @ApiPropertyOptional({ description: 'Default hold time of a reservation or lease, ms', default: 600_000, minimum: 1000 })
  @Omittable()
  @IsInt()
  @Min(1000)
  @Max(MAX_TTL_MS)
  holdTtlMs?: number;

  @ApiPropertyOptional({
    description: 'Longest hold a caller may ask for, ms (at least holdTtlMs; send it with a holdTtlMs above its default)',
    default: 3_600_000,
    minimum: 1000,
  })
  @Omittable()
  @IsInt()
  @Min(1000)
  @Max(MAX_TTL_MS)
  maxHoldTtlMs?: number;

  @ApiPropertyOptional({
    description: 'Most items one owner may hold at once in this pool; omitted or null = no limit',
    nullable: true,
    minimum: 1,
  })
  @IsOptional()
  @IsInt()
  @Min(1)
  @Max(1_000_000)
  maxHoldsPerOwner?: number | null;
}

export class PoolDto {
  @ApiProperty({ description: 'Unique pool name', example: 'phone-bj' })
  name: string;

  @ApiProperty({ description: 'Pool kind', enum: POOL_KINDS })
  kind: PoolKind;

  @ApiProperty({ type: 'integer', description: 'Default hold time, ms' })
  holdTtlMs: number;

  @ApiProperty({ type: 'integer', description: 'Longest hold a caller may ask for, ms' })
  maxHoldTtlMs: number;

  @ApiProperty({ description: 'Most items one owner may hold at once; null = no limit', nullable: true, type: 'integer' })
  maxHoldsPerOwner: number | null;

  @ApiProperty({ description: 'When the pool was created (ISO-8601 UTC)', format: 'date-time' })
  createdAt: string;
}

export class PoolStatsDto {
  @ApiProperty({ type: 'integer', description: 'Items in the pool' })
  total: number;

  @ApiProperty({ type: 'integer', description: 'Items that can be reserved now' })
  free: number;

  @ApiProperty({
    type: 'integer',
    description:
      'Items neither allocated nor in the free index: under a hold (a live reservation or lease, or an expired one not yet swept), or free in Postgres but not (yet) indexed in Redis (after a failed Redis write or a wipe, until the rebuild)',
  })
  held: number;

  @ApiProperty({ type: 'integer', description: 'Items allocated to an owner' })
  allocated: number;
}

export class PoolWithStatsDto extends PoolDto {
  @ApiProperty({ description: 'Item counts by state', type: PoolStatsDto })
  stats: PoolStatsDto;
}

export class ImportItemDto {
  @ApiProperty({ description: 'The item handed out (a phone number, a task id): unique within the pool', minLength: 1, maxLength: 256 })
  @IsString()
  @IsCharLength(1, 256)
  value: string;

  @ApiPropertyOptional({
    description:
      'Flat object of string values (at most 32, keys of 1 to 64 characters), usable in reservation filters; null or left out: none',
    type: 'object',
    additionalProperties: { type: 'string' },
    nullable: true,
    example: { city: 'bj' },
  })
  @IsOptional()
  @IsFlatStringRecord()
  attributes?: Record<string, string> | null;

  @ApiPropertyOptional({
    description:
      'Group of the item (task pools: pull-next gives a reviewer a task of a group it already leases in before one of another ' +
      'group); null or left out: none',
    type: 'string',
    maxLength: 256,
    nullable: true,
  })
  @IsOptional()
  @IsString()
  @IsCharLength(1, 256)
  groupKey?: string | null;
}

export class ImportResourcesDto {
  @ApiProperty({ description: 'Items to add, 1 to 10,000', type: [ImportItemDto] })
  @IsArray()
  @ArrayMinSize(1)
  @ArrayMaxSize(MAX_IMPORT_ITEMS)
  @IsObject({ each: true })
  @ValidateNested({ each: true })
  @Type(() => ImportItemDto)
  items: ImportItemDto[];
}

export class ImportResultDto {
  @ApiProperty({ type: 'integer', description: 'Items added (free at once)' })
  inserted: number;

  @ApiProperty({ type: 'integer', description: 'Items whose value was already in the pool (left unchanged)' })
  duplicates: number;
}

export const RESOURCE_STATES = ['free', 'held', 'allocated'] as const;

export class ResourceDto {
  @ApiProperty({ description: 'Resource id', example: '5780' })
  id: string;

  @ApiProperty({ description: 'Pool name' })
  pool: string;

  @ApiProperty({ description: 'The item handed out' })
  value: string;

  @ApiProperty({ description: 'free, held (under a live hold) or allocated', enum: RESOURCE_STATES })
  state: (typeof RESOURCE_STATES)[number];

  @ApiProperty({ type: 'integer', description: 'Row version: incremented by every allocation and release (the fencing token)' })
  version: number;

  @ApiProperty({ description: 'Owner the item is allocated to; null unless allocated', nullable: true, type: String })
  owner: string | null;

  @ApiProperty({ description: 'Attributes of the item', type: 'object', additionalProperties: { type: 'string' } })
  attributes: Record<string, string>;

  @ApiProperty({ description: 'Group of the item', nullable: true, type: String })
  groupKey: string | null;

  @ApiProperty({
    description:
      "When the item's row last changed in Postgres (ISO-8601 UTC): its import, allocation or release; a hold (kept in " +
      'Redis) does not change it',
    format: 'date-time',
  })
  updatedAt: string;
}

export class ReleaseResourceDto {
  @ApiProperty({ description: 'The owner the item is allocated to', minLength: 1, maxLength: 128 })
  @IsString()
  @IsCharLength(1, 128)
  owner: string;
}
