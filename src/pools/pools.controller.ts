import { Body, Controller, Get, HttpCode, Param, Post } from '@nestjs/common';
import { ApiCreatedResponse, ApiOkResponse, ApiOperation, ApiTags } from '@nestjs/swagger';
import { ActingFor, mustActFor, Roles } from '../common/auth.js';
import { ApiErrors } from '../common/api-errors.decorator.js';
import { ErrorCode } from '../common/errors.js';
import {
  CreatePoolDto,
  ImportResourcesDto,
  ImportResultDto,
  PoolDto,
  PoolParams,
  PoolWithStatsDto,
  ReleaseResourceDto,
  ResourceDto,
  ResourceParams,
} from './pool.dto.js';
import { PoolsService } from './pools.service.js';

@ApiTags('pools')
@Controller('v1/pools')
export class PoolsController {
  constructor(private readonly pools: PoolsService) {}

  @Post()
  @Roles('admin')
  @ApiOperation({ summary: 'Create a pool' })
  @ApiCreatedResponse({ type: PoolDto, description: 'The pool created' })
  @ApiErrors(ErrorCode.VALIDATION_FAILED, ErrorCode.POOL_EXISTS, ErrorCode.PAYLOAD_TOO_LARGE)
  create(@Body() dto: CreatePoolDto): Promise<PoolDto> {
    return this.pools.create(dto);
  }

  @Get()
  @Roles('admin')
  @ApiOperation({ summary: 'List pools' })
  @ApiOkResponse({ type: [PoolDto], description: 'Every pool' })
  @ApiErrors()
  list(): Promise<PoolDto[]> {
    return this.pools.list();
  }

  @Get(':pool')
  @Roles('admin')
  @ApiOperation({ summary: 'A pool with its item counts' })
  @ApiOkResponse({ type: PoolWithStatsDto, description: 'The pool and how many of its items are in each state' })
  @ApiErrors(ErrorCode.VALIDATION_FAILED, ErrorCode.POOL_NOT_FOUND)
  get(@Param() params: PoolParams): Promise<PoolWithStatsDto> {
    return this.pools.get(params.pool);
  }

  @Post(':pool/resources')
  @Roles('admin')
  @ApiOperation({ summary: 'Bulk import items (at most 10,000 a call); values already in the pool count as duplicates' })
  @ApiCreatedResponse({ type: ImportResultDto, description: 'How many items were added, and how many were already there' })
  @ApiErrors(ErrorCode.VALIDATION_FAILED, ErrorCode.POOL_NOT_FOUND, ErrorCode.PAYLOAD_TOO_LARGE)
  importResources(@Param() params: PoolParams, @Body() dto: ImportResourcesDto): Promise<ImportResultDto> {
    return this.pools.importResources(params.pool, dto);
  }

  @Get(':pool/resources/:id')
  @Roles('admin')
  @ApiOperation({ summary: 'One item and its state' })
  @ApiOkResponse({ type: ResourceDto, description: 'The item' })
  @ApiErrors(ErrorCode.VALIDATION_FAILED, ErrorCode.POOL_NOT_FOUND, ErrorCode.RESOURCE_NOT_FOUND)
  getResource(@Param() params: ResourceParams): Promise<ResourceDto> {
    return this.pools.getResource(params.pool, params.id);
  }

  @Post(':pool/resources/:id/release')
  @Roles('client', 'admin')
  @HttpCode(200)
  @ApiOperation({
    summary: 'Release an allocated item back to the pool (its version is incremented)',
    description:
      'A client key bound to an owner cannot release an item that a task lease of a reviewer of the same name completed ' +
      '(409 NOT_ALLOCATED): owners and reviewers share one space of names.',
  })
  @ApiOkResponse({ type: ResourceDto, description: 'The item, free again, its version incremented' })
  @ApiErrors(ErrorCode.VALIDATION_FAILED, ErrorCode.POOL_NOT_FOUND, ErrorCode.RESOURCE_NOT_FOUND, ErrorCode.NOT_ALLOCATED)
  release(
    @Param() params: ResourceParams,
    @Body() dto: ReleaseResourceDto,
    @ActingFor() actingFor: string | undefined,
  ): Promise<ResourceDto> {
    mustActFor(actingFor, dto.owner);
    return this.pools.releaseResource(params.pool, params.id, dto.owner, actingFor === undefined);
  }
}
